"""Mixture-of-experts dispatch: routing, tokens to their experts and back."""

from ops.moe_dispatch.api import choose_dropless_impl
from ops.moe_dispatch.api import DROPLESS_IMPLS
from ops.moe_dispatch.api import DroplessImpl
from ops.moe_dispatch.api import GROUPED_MATMUL_IMPLEMENTATIONS
from ops.moe_dispatch.api import GroupedMatmulImplementation
from ops.moe_dispatch.api import IMPLEMENTATIONS
from ops.moe_dispatch.api import moe_dispatch
from ops.moe_dispatch.reference import moe_dispatch_reference
from ops.moe_dispatch.routing import load_balance_loss
from ops.moe_dispatch.routing import route
from ops.moe_dispatch.routing import router_logits
from ops.moe_dispatch.routing import router_z_loss
from ops.moe_dispatch.routing import Routing
from ops.moe_dispatch.routing import tokens_per_expert
from ops.moe_dispatch.routing import top_k_experts
from ops.moe_dispatch.sorting import capacity_positions
from ops.moe_dispatch.sorting import expert_capacity
from ops.moe_dispatch.sorting import sort_by_expert

__all__ = ("capacity_positions", "choose_dropless_impl", "DROPLESS_IMPLS", "DroplessImpl",
           "expert_capacity", "GROUPED_MATMUL_IMPLEMENTATIONS",
           "GroupedMatmulImplementation", "IMPLEMENTATIONS", "load_balance_loss", "moe_dispatch",
           "moe_dispatch_reference", "route", "router_logits", "router_z_loss", "Routing",
           "sort_by_expert", "tokens_per_expert", "top_k_experts")
