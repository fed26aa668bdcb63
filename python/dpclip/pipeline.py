"""Pipeline schedules for gradient accumulation over norm groups (issue 39):
the order in which one stage runs the forwards and backwards of a logical
step's micro-batches. Each micro-batch's backward sends it to the daemon as
one micro-batch of the logical step (its per-sample norms summed over the
stages by the norm group), and optimizer.step() after the last commits it:

    for op, i in schedule("1f1b", stages=2, stage=rank, micro_batches=8):
        ...  # op "F": forward micro-batch i (send its activations on);
             # op "B": backward micro-batch i (send its input gradient back)
    optimizer.step()

examples/train_pipeline.py runs both schedules over two stages."""
from typing import List, Tuple

__all__ = ["schedule"]


def schedule(kind: str, stages: int, stage: int, micro_batches: int) -> List[Tuple[str, int]]:
    """This stage's order of forwards ("F", i) and backwards ("B", i) of
    the micro-batches: "gpipe" (every forward, then the backwards, the last
    micro-batch's first) or "1f1b" (stages - stage - 1 forwards to warm up,
    then a forward and a backward in turn, then the backwards left). Every
    stage runs the forwards in the batch's order under both, so the members
    of a norm group number each micro-batch alike."""
    if kind not in ("gpipe", "1f1b"):
        raise ValueError("schedule: kind must be 'gpipe' or '1f1b', got %r" % (kind,))
    if not 0 <= stage < stages or micro_batches < 0:
        raise ValueError("schedule: stage %d of %d stages, %d micro-batches"
                         % (stage, stages, micro_batches))
    m = micro_batches
    if kind == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
    warm = min(m, stages - stage - 1)
    ops, f = [("F", i) for i in range(warm)], warm
    for b in range(m):
        if f < m:
            ops.append(("F", f))
            f += 1
        ops.append(("B", b))
    return ops
