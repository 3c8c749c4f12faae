"""`minimal-fsdp plan`: a model's parameters, checkpoint size and the memory (and, with
--inter_node_gbps, the step time) of every sharding strategy (tools/model_size.py), without
importing torch."""

from minimal_fsdp.tools import model_size


def main(flags):
    """PlanFlags -> the tables on stdout."""
    model_size.print_plan(flags)
