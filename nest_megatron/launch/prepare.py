"""From a launch line to what each node runs: argv -> problem -> plan -> rewritten argv -> torchrun commands.

Every node of a job calls `prepare` with the same inputs and gets the same plan (the planner is
deterministic), so no node has to tell another what was chosen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from nest_megatron import api
from nest_megatron.config.load import Loaded, load
from nest_megatron.config.megatron_argv import (
    FLAG_OF_KEY,
    MODEL_FLAGS,
    check_precision,
    has_model,
    model_overrides,
    scan,
    train_overrides,
)
from nest_megatron.errors import NestError
from nest_megatron.launch.changes import change_lines, flag_reasons, layout_why
from nest_megatron.launch.constraints import Constraint, argv_constraints
from nest_megatron.launch.devices import Devices
from nest_megatron.launch.megatron_rules import violations
from nest_megatron.launch.placement import HostAssignment, host_assignments, hosts_in_device_order, master_host
from nest_megatron.launch.rewrite import model_part, parse_pins, pin_overrides, planner_part, rewrite
from nest_megatron.launch.torchrun import NodeCommand, node_command, torchrun_flags
from nest_megatron.launch.vocabulary import vocabulary_flags
from nest_megatron.plan import Plan

KEEP_KEY = "solver.keep_user_parallelism"
DIGEST_FORMAT = re.compile(r"^[0-9a-f]{12}$")


@dataclass
class Prepared:
    plan: Plan
    loaded: Loaded
    devices: Devices
    script_args: list[str]  # the final Megatron argv
    commands: list[NodeCommand]  # one per node that runs ranks, in node-index order
    this_node: NodeCommand | None  # the command of the node this process runs on; None: known only per node
    # `--flag: old -> new (why)` for each flag of the argv the plan changed (launch/changes.py)
    changes: list[str] = field(default_factory=list)


def split_keep(overrides: list[str]) -> tuple[list[str], list[str]]:
    """`solver.keep_user_parallelism=[tp,pp]` is a launch option (it reads the argv): (other overrides, names)."""
    rest, names = [], []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == KEEP_KEY:
            names += parse_pins(value.strip("[]").replace("'", "").replace('"', ""))
        else:
            rest.append(item)
    return rest, names


def problem_overrides(script: str, script_args: list[str], user: list[str]) -> list[str]:
    """The Hydra overrides of the launch: the argv's model and train settings, then the user's (which win)."""
    s = scan(script_args)
    keys = {item.partition("=")[0]: item.partition("=")[2] for item in user}
    if has_model(s):
        if "model" in keys:
            raise NestError(f"model={keys['model']} and a model in the script arguments (--num-layers ...): give one")
        vocab = keys.get("model.vocab_size")
        family = "bert" if Path(script).name.startswith("pretrain_bert") else "gpt"
        out = model_overrides(s, name=Path(script).stem, family=family,
                              vocab_size=int(vocab) if vocab and vocab.isdigit() else None)
    else:
        check_precision(s, required=False)
        stray = [flag for flag in MODEL_FLAGS if s.has(flag)]
        if stray:
            raise NestError(f"{stray[0]} without --num-layers: give the whole model in the script arguments, or none "
                            "of it and model=NAME")
        out = []
    return out + train_overrides(s) + list(user)


def _with_flags(err: NestError, flags_given: bool) -> NestError:
    """A config error about a model.* key the argv set, naming the flag too."""
    if not flags_given:
        return err
    text = re.sub(r"\b(model\.\w+|train\.global_batch_size)\b",
                  lambda m: f"{FLAG_OF_KEY[m.group(1)]} ({m.group(1)})" if m.group(1) in FLAG_OF_KEY else m.group(1), str(err))
    return type(err)(text)


def _check_topology(loaded: Loaded, devices: Devices) -> None:
    topo = loaded.problem.topology
    working = loaded.problem.num_devices
    if devices.num_devices not in (working, working + len(topo.failed_hosts) * topo.devices_per_node):
        failed = f" on its working nodes ({len(topo.failed_hosts)} failed)" if topo.failed_hosts else ""
        raise NestError(f"cluster {topo.name} has {working} devices{failed}, but the launch starts "
                        f"{devices.num_nodes} x {devices.per_node} = {devices.num_devices}")
    if topo.devices_per_node != devices.per_node:
        raise NestError(f"cluster {topo.name} has {topo.devices_per_node} devices per node, but the launch starts "
                        f"{devices.per_node} per node; choose a matching cluster=... or cluster.levels")


def prepare(*, overrides: list[str], script: str, script_args: list[str], devices: Devices, pins: list[str] = (),
            user_torchrun_flags: list[str] | None = None) -> Prepared:
    """Plan the launch and build its torchrun command(s). Raises NestError (one line) and starts nothing when
    the input is wrong, the plan does not fit, or the cluster does not match the devices."""
    user, kept = split_keep(list(overrides))
    names = list(dict.fromkeys([*parse_pins(pins), *kept]))
    flags_given = has_model(scan(script_args))
    problem = problem_overrides(script, script_args, user)
    if not any(item.startswith(("cluster.num_devices=", "cluster.failed_nodes=")) for item in user):
        problem.append(f"cluster.num_devices={devices.num_devices}")  # with failed nodes, the working ones count
    try:
        loaded = load(problem)
        _check_topology(loaded, devices)
        model = loaded.config.model
        fixed = [Constraint(pin_overrides(script_args, names, model=model), f"pinned {','.join(names)}")] if names else []
        fixed += argv_constraints(script_args, user, model=model, pinned=names)
        if fixed:
            loaded = load(problem + [item for c in fixed for item in c.overrides])
        plan = _plan(loaded, [c.why for c in fixed])
    except NestError as err:
        raise _with_flags(err, flags_given) from None

    present = scan(script_args)
    try:
        vocab_args, vocab_notes = vocabulary_flags(present, loaded.config.model, plan.vocabulary["padded_rows"],
                                                   model_from_argv=flags_given)
    except NestError as err:
        raise _with_flags(err, flags_given) from None
    model_args = []
    if not flags_given:  # the model came from model=...: the script needs its shape too
        model_args = [a for a in model_part(plan.megatron_args)
                      if not (a == "--bf16" and (present.has("--bf16") or present.has("--fp16")))]
    final = rewrite(script_args, plan, model_args=model_args + vocab_args)
    broken = violations(final, world_size=plan.world_size)
    if broken:
        raise NestError(f"the rewritten argv breaks a Megatron rule (a planner bug, please report): {broken[0]}")
    changes = change_lines(script_args, final, reasons=flag_reasons(planner_part(plan.megatron_args), script_args),
                           layout=lambda argv: layout_why(argv, loaded, plan)) + vocab_notes

    commands, this_node = _commands(plan, devices, script, final, user_torchrun_flags)
    return Prepared(plan=plan, loaded=loaded, devices=devices, script_args=final, commands=commands, this_node=this_node,
                    changes=changes)


def _plan(loaded: Loaded, fixed_by: list[str]) -> Plan:
    """The plan; when what the launch line fixes (`fixed_by`: --pin, a resume, ...) leaves none, one line
    saying so."""
    try:
        return api.plan_loaded(loaded)
    except NestError as err:
        if not fixed_by:
            raise
        raise type(err)(f"no plan keeps what the launch line fixes ({'; '.join(fixed_by)}): {err}") from None


def check_digest_format(expected: str) -> None:
    if not DIGEST_FORMAT.match(expected):
        raise NestError(f"--expect-plan {expected!r}: give the 12 hex digits of a plan digest "
                        "(nest-megatron sbatch writes it; launch --dry-run prints it)")


def check_expected_plan(plan: Plan, expected: str) -> None:
    """Refuse a node whose plan is not the job's: Megatron would start with other sizes on this node."""
    if plan.digest != expected:
        raise NestError(f"this node planned {plan.digest}, but the job expects plan {expected} (--expect-plan): "
                        "nothing started; a different nest-megatron version, cluster config or profile cache on "
                        "this node (or on the node that wrote the job) changes the plan, or SLURM booked the nodes "
                        "on other switches or racks than it was planned on (docs/guide.md, 'Whole racks')")


def megatron_env(plan: Plan) -> dict[str, str | None]:
    """The environment Megatron-LM asserts at start (validate_args, on Hopper and earlier GPUs): with TP or CP
    it needs CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue, so that its communication kernels are issued in
    order); Megatron-FSDP needs it not to be 1 (None: removed), on every GPU (arguments.py:1048, 1166).

    On Blackwell Megatron no longer asserts the 1 (arguments.py:1453-1455: "requirement no longer exists since the
    Blackwell architecture"; Megatron-Bridge's Blackwell recipes set 32, scripts/performance/utils/overrides.py:
    258-262); the launch keeps 1 there too: Megatron accepts it, and it is the stream order the cost model prices
    (cost/layer.py ordered_streams). A TP group across the trays of a GB200 NVL72 rack needs nothing more here:
    NCCL finds the rack's NVLink itself (MNNVL, NCCL_MNNVL_ENABLE=2 by default: nccl src/init.cc).

    --overlap-moe-expert-parallel-comm runs its all-to-alls on a stream of their own beside the computation, which one
    queue would serialise: Megatron then only warns with TP or CP (arguments.py:1466-1475), and Megatron-Bridge's perf
    launches set 8 queues, 32 with DeepEP or HybridEP (scripts/performance/perf_plugins.py:206-236 at v0.2.0); so does
    this launch (the cost model then prices the TP collectives unordered: cost/layer.py ordered_streams)."""
    if plan.zero_stage >= 2:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if "--overlap-moe-expert-parallel-comm" in plan.megatron_args:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "32" if "flex" in plan.megatron_args else "8"}
    if plan.parallel["tp"] > 1 or plan.parallel["cp"] > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _hosts(plan: Plan, devices: Devices) -> list[str]:
    """The launch's hosts in the plan's device order: the planned allocation's when the plan names its hosts
    (a switch tree may order them otherwise than SLURM lists them), else SLURM's order, else placeholders.
    The plan's failed hosts may be in the launch's list (SLURM keeps a failed node in the job's); they run nothing."""
    if plan.hosts:
        failed = set(plan.failed_hosts)
        if sorted(plan.hosts) != sorted(h for h in devices.hosts if h not in failed):
            raise NestError(f"the plan is for hosts {','.join(plan.hosts)}, but the launch runs on "
                            f"{','.join(devices.hosts) or f'{devices.num_nodes} unnamed nodes'}")
        return hosts_in_device_order(plan)
    return list(devices.hosts) or [f"node{i}" for i in range(devices.num_nodes)]


def _commands(plan: Plan, devices: Devices, script: str, final: list[str],
              user_flags: list[str] | None) -> tuple[list[NodeCommand], NodeCommand | None]:
    """One torchrun command per node that runs ranks; the plan's placement gives each node its --node-rank and
    CUDA_VISIBLE_DEVICES (launch/placement.py)."""
    assignments: list[HostAssignment] = host_assignments(plan, _hosts(plan, devices))
    running = [a for a in assignments if not a.idle]
    if user_flags is not None:
        # nest-torchrun: the user's torchrun flags stay as typed, so the placement must keep torchrun's node order.
        if plan.idle_devices or any(a.node_rank != i for i, a in enumerate(assignments)):
            raise NestError("the plan leaves devices idle or reorders the nodes, which torchrun flags as typed cannot "
                            "realise; launch it with `nest-megatron launch` (or srun nest-megatron launch)")
        commands = [node_command(user_flags, script, final, node_rank=a.node_rank, env={**a.env(), **megatron_env(plan)})
                    for a in assignments]
        if devices.node_rank is not None:
            # The flags as typed (--node-rank R, or SLURM's node) are this node's: its command is the only true one.
            commands = [commands[devices.node_rank]]
        elif len({c.render() for c in commands}) > 1:
            raise NestError(f"the plan orders the GPUs differently on each of the {devices.num_nodes} nodes, which "
                            "torchrun flags without --node-rank cannot realise; give each node its --node-rank, or "
                            "launch it with `nest-megatron launch`")
    else:
        if devices.num_nodes > 1 and not devices.hosts and assignments[0].node_rank != 0:
            raise NestError(f"the plan puts node rank 0 on node index {[a.node_rank for a in assignments].index(0)}; "
                            "without SLURM host names, start it with --master-addr of that node")
        placed = devices if not devices.hosts else _with_master(devices, master_host(assignments))
        commands = []
        for a in running:
            one = Devices(num_nodes=a.nnodes, per_node=a.nproc_per_node, master_addr=placed.master_addr,
                          master_port=placed.master_port)
            commands.append(node_command(torchrun_flags(one, node_rank=a.node_rank), script, final,
                                         node_rank=a.node_rank, env={**a.env(), **megatron_env(plan)}))
    this = None
    if devices.node_rank is not None:  # this process runs on node index devices.node_rank (SLURM_NODEID, ...)
        # By name where the nodes have names: the plan's device order need not be SLURM's.
        mine = (next((a for a in assignments if a.host == devices.hosts[devices.node_rank]), None) if devices.hosts
                else assignments[devices.node_rank])  # None: a failed host of the plan
        this = next((c for c in commands if c.node_rank == mine.node_rank), None) if mine and not mine.idle else None
    return commands, this


def _with_master(devices: Devices, host: str) -> Devices:
    return Devices(num_nodes=devices.num_nodes, per_node=devices.per_node, node_rank=devices.node_rank,
                   hosts=devices.hosts, master_addr=host, master_port=devices.master_port, source=devices.source)
