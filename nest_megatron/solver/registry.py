"""Planners by the name `solver.name` takes."""

from nest_megatron.solver import dp, enumerate

SOLVERS = {
    "dp": dp.solve,  # the layer split by dynamic programming, configurations pruned by bounds
    "enumerate": enumerate.solve,  # every configuration with the even split: the brute force
}
