"""The planner: memory and time of every parallel plan, ranked. `best_plan` is what `train --plan auto` calls."""

from paraseek.planner.memory import model_state_bytes
from paraseek.planner.plan import Cluster, Plan, load_profile, make_cluster
from paraseek.planner.search import Evaluated, best_plan, evaluate, search

__all__ = ["Cluster", "Plan", "Evaluated", "best_plan", "evaluate", "load_profile", "make_cluster",
           "model_state_bytes", "search"]
