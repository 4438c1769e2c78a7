"""Steady-state cost per step of the trainer hook against plain torch, same model, data and loop.

    python -m bench.overhead [--models gpt mlp] [--worlds 2 4] [--steps 60] [--repeats 3]
    python -m bench.overhead --phases 40 [--phase-steps 24] [--sides hook-ddp hook-hsdp] ...
    python -m bench.overhead --quick [--phases 2]  # CI: the MLP on 2 ranks, nothing asserted

Sides (bench/overhead/rank.py runs every one of them through the same step loop):

- ``ddp``: plain torch DDP on gloo, its own processes and store: the baseline;
- ``stable-ddp``: the same DDP over the hook's stable process group (gloo underneath, buckets
  settled as ``register()`` settles them) with no session and no agent: what the group alone
  costs;
- ``hook-ddp``: the same DDP over the session's stable process group, under ``flashrecovery
  run``; ``commit()`` only votes;
- ``hook``: the hook's own reduce (no DDP): ``commit()`` averages the gradients, votes and steps;
- ``hsdp``: plain FSDP2 on a (ranks / 2) x 2 replicate x shard mesh: the HSDP baseline;
- ``hook-hsdp``: the same HSDP over the session's stable mesh, under ``flashrecovery run``;
- ``tp-hsdp``: tensor parallel beside FSDP2 on a (ranks / 2) x 1 x 2 ("dp_replicate",
  "dp_shard", "tp") mesh, the feed-forward layers split over "tp" (the demo's plan; the MLP's
  linear layers in pairs): the baseline;
- ``hook-tp-hsdp``: the same over the session's stable mesh, under ``flashrecovery run``;
- ``pp``: two pipeline stages (GPipe over 2 microbatches), each in torch DDP over its
  (ranks / 2) replicas (the demo's split; the MLP's layers in halves): the baseline;
- ``hook-pp``: the same over the session's stable mesh, the schedule registered.

A hook side pays everything the hook adds: the vote on the store, the StepCompleted record, the
heartbeat and decisions threads, and the agent (with its engine) on the same cores. Beside wall
time it counts CPU: each rank's per step, and the agent's over the ranks' steady steps, so the
hook's whole cost in CPU per step (every rank plus the agent, against the baseline's ranks) is
there too; unlike wall time on shared cores, a busy machine barely moves it. Runs are
interleaved (each repeat rotates the order, so a busy spell hits every side) and each repeat's
hook side is compared with the same repeat's baseline. The overhead shown is the median of
those paired overheads, with an interval that covers their median with at least 90 % whatever
the noise's shape (order statistics: up to 7 repeats it is their range, which 5 repeats make
94 % sure), and whether that decides the 5 % goal: "yes" (all of it at or below), "no"
(all above), "undecided" (the machine's noise is wider than the question) or "too few
repeats" (under 5: their range covers the median with under 90 %). Results:
bench/results/overhead.json (with the load average around every run), a table, and
bench/results/overhead.png; ``--render`` summarizes a JSON written before again, and given
several pools each cell's pairs over all of them (bench/results/overhead_pooled.json). It
measures; it asserts nothing.

``--phases N`` measures differently, because on a shared machine separate runs half a minute
apart meet different machines: each hook side and its baseline run at once and take turns
(turns.py), N phases of ``--phase-steps`` steps each, the first of each pair of phases
rotating; the first steps of a phase (after its wait) are left out. Each pair of neighbouring
phases is a paired overhead, so one run gives N pairs a second or two apart. The job that waits
is not stopped: its threads and its agent go on, and what the waiting hook job takes of the
cores beyond what the waiting baseline takes is added to every paired overhead (the most it
could have slowed the baseline), so the verdict errs against the hook. "Job CPU" is then every
process of the job (ranks, agent, fork server) per step of its phases.
"""
