"""Plans as overrides for NeMo 2 recipes and Megatron-Bridge configs (no NeMo import needed to emit them).

    from nest_megatron import api
    from nest_megatron.integrations import apply_to_recipe
    recipe = llm.llama3_8b.pretrain_recipe(num_nodes=4, num_gpus_per_node=8)
    apply_to_recipe(recipe, api.plan(["model=llama3_8b", "cluster.num_devices=32"]), devices_per_node=8)
"""

from nest_megatron.integrations.bridge import apply_to_config, bridge_overrides
from nest_megatron.integrations.nemo import apply_to_recipe, nemo_overrides

__all__ = ["apply_to_config", "apply_to_recipe", "bridge_overrides", "nemo_overrides"]
