"""bench_fsdp.py --check: dpclip's sharded step against one process.

3 steps at sigma 0 with fixed batches (step s: a global batch of G samples
from seed 1000 + s, G = world x B, or --logical; rank r takes rows
r*G/world..(r+1)*G/world, with --logical in micro-batches of --micro: several
backward() calls, each micro-batch's own mean loss, then one step()), SGD
at lr 1; then the parameters, gathered whole, against one process on one
GPU (cuda:0) training the unsharded model with dpclip on each whole global
batch in one step (expected batch G). Under bf16 that process keeps f32
master weights and steps a bf16 copy, as FSDP's MixedPrecisionPolicy does.
Printed: the largest absolute difference of a parameter; per tensor,
against its update (the reference's change over the steps), the largest
element's difference over the largest update, and the L2 norm of the
difference over the update's (the check: every tensor within 5e-2 in bf16,
5e-3 in fp32; --check-tol); all updates' L2 difference; the losses. The
exit status is 1 outside the tolerance, or where nothing moved. The
one-GPU process holds the whole global batch's activations: T=2048 with 16
Llama samples does not fit an 80 GB GPU; --seq 512 does; with --logical
keep G small (e.g. --logical 32 --micro 4 --seq 512).

BENCH_FSDP_CHECK_FAULT=zero_grad makes the ranks call zero_grad() before
every micro-batch (a loop that does not accumulate: only the last
micro-batch counts), so that a test can see the check fail.

The functions run in bench_fsdp.py's spawned processes and use the helpers
it shares with them (fsdp_common.py).
"""
import json
import math
import os
import warnings

import torch
import torch.distributed as dist

from bench_torch_step import token_batch
import fsdp_common as fc

CHECK_STEPS = 3
CHECK_LR = 1.0  # updates well above the f32 master weights' rounding
CHECK_TOL = {"bf16": 5e-2, "fp32": 5e-3}


def global_batch(args, world, step):
    """The check's global batch of a step: G samples."""
    return token_batch(args, torch.device("cpu"), seed=1000 + step,
                       batch=fc.global_size(args, world))


def check_rank(rank, world, init_file, args, out_dir):
    """CHECK_STEPS dpclip steps at sigma 0 on this rank's rows of each
    global batch (in micro-batches with --logical); rank 0 saves the
    parameters, gathered whole, and the global mean loss of each step."""
    init = fc.prepare(args)
    device, mesh = fc.init_rank(rank, world, init_file, args, 600)
    if rank == 0:
        fc.log("check: rank 0's initial model built, process group up on %s" % device)
    fault = os.environ.get("BENCH_FSDP_CHECK_FAULT", "")
    try:
        model = fc.shard(fc.fresh_model(args, device, init), mesh, args)
        engine, model, opt = fc.private(args, model, world, mesh is None, 0.0, CHECK_LR)
        per_rank = fc.global_size(args, world) // world
        micro = args.micro if args.logical else per_rank
        losses = []
        for s in range(CHECK_STEPS):
            xs, ys = global_batch(args, world, s)
            xs, ys = (t[rank * per_rank:(rank + 1) * per_rank] for t in (xs, ys))
            opt.zero_grad(set_to_none=True)
            total = torch.zeros(1, device=device)
            for at in range(0, per_rank, micro):
                if fault == "zero_grad" and at:
                    with warnings.catch_warnings():  # dpclip warns that it drops the step
                        warnings.simplefilter("ignore")
                        opt.zero_grad(set_to_none=True)
                # each micro-batch's own mean: dpclip rescales by its size
                loss = fc.seq_loss(model(xs[at:at + micro].to(device)),
                                   ys[at:at + micro].to(device))
                loss.backward()
                total += loss.detach() * (min(micro, per_rank - at) / per_rank)
            opt.step()
            dist.all_reduce(total)
            losses.append(float(total) / world)
            if rank == 0:
                fc.log("check: step %d/%d, loss %.5f" % (s + 1, CHECK_STEPS, losses[-1]))
        engine.close()
        # What the module holds after the steps: a parameter that is not the
        # sharded one FSDP steps (an unsharded copy left registered) is
        # reported, and read as the optimizer's after reshard().
        held = {n: "%s/%s" % (type(p).__name__, str(p.dtype).replace("torch.", ""))
                for n, p in model.named_parameters()}
        if hasattr(model, "reshard"):
            model.reshard()
        final = {}
        with torch.no_grad():
            for n, p in model.named_parameters():
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                if rank == 0:
                    final[n] = whole.float().cpu()
        if rank == 0:
            torch.save({"final": final, "losses": losses, "held": held},
                       os.path.join(out_dir, "check.pt"))
    finally:
        dist.destroy_process_group()


def check_reference(_, world, args, out_dir, mixed):
    """One process, one device: the unsharded model, dpclip on each whole
    global batch. mixed (bf16 under FSDP): f32 master weights stepped with
    the gradient of a bf16 copy, as MixedPrecisionPolicy does."""
    init = fc.prepare(args)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    master = fc.fresh_model(args, device, init)
    work = fc.fresh_model(args, device, init).to(torch.bfloat16) if mixed else master
    engine, work, opt = fc.private(args, work, world, False, 0.0, 0.0 if mixed else CHECK_LR)
    losses = []
    for s in range(CHECK_STEPS):
        xs, ys = global_batch(args, world, s)
        opt.zero_grad(set_to_none=True)
        loss = fc.seq_loss(work(xs.to(device)), ys.to(device))
        loss.backward()
        opt.step()
        if mixed:
            with torch.no_grad():
                for pm, pw in zip(master.parameters(), work.parameters()):
                    pm.add_(pw.grad.float(), alpha=-CHECK_LR)
                    pw.copy_(pm)
        losses.append(float(loss))
        fc.log("check reference: step %d/%d, loss %.5f" % (s + 1, CHECK_STEPS, losses[-1]))
    engine.close()
    final = {n: p.detach().float().cpu() for n, p in master.named_parameters()}
    torch.save({"init": init, "final": final, "losses": losses},
               os.path.join(out_dir, "reference.pt"))


def compare(ref, got):
    """The parameters' differences: the largest absolute one; per tensor,
    relative to the tensor's update (its reference's change over the
    steps), the largest element's against the largest update and, the
    check, the difference's L2 norm against the update's (robust to an
    element whose update is rounding alone); and all updates' L2."""
    out = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "max_rel_param": None,
           "max_tensor_l2_rel_diff": 0.0, "l2_worst_param": None, "max_abs_update": 0.0}
    num = den = 0.0
    per = {}
    for n, p0 in ref["init"].items():
        pr, pf = ref["final"][n].double(), got["final"][n].double()
        upd = pr - p0.double()
        diff = (pf - pr).abs()
        d, scale = float(diff.max()), float(upd.abs().max())
        dd, uu = float((diff ** 2).sum()), float((upd ** 2).sum())
        rels = (("max_rel_diff", "max_rel_param", d / scale if scale > 0 else
                 (0.0 if d == 0 else math.inf)),
                ("max_tensor_l2_rel_diff", "l2_worst_param", math.sqrt(dd / uu) if uu > 0 else
                 (0.0 if dd == 0 else math.inf)))
        for key, worst, rel in rels:
            if out[worst] is None or rel > out[key]:
                out[key], out[worst] = rel, n
        per[n] = math.sqrt(dd / uu) if uu > 0 else (0.0 if dd == 0 else math.inf)
        out["max_abs_diff"] = max(out["max_abs_diff"], d)
        out["max_abs_update"] = max(out["max_abs_update"], scale)
        num += dd
        den += uu
    out["update_l2_rel_diff"] = math.sqrt(num / den) if den > 0 else math.inf
    out["l2_rel_diff_top"] = {n: round(v, 6) for n, v in sorted(
        per.items(), key=lambda kv: -kv[1])[:5]}
    return out


def check(args, out_dir, sharded):
    """The reference, then the ranks, then the comparison line; the exit
    status."""
    precision = args.precision if sharded else "fp32"  # no policy without fully_shard
    tol = args.check_tol if args.check_tol is not None else CHECK_TOL[precision]
    size = fc.global_size(args, args.world)
    fc.log("check: the reference, one process on %s, %d samples a step"
           % ("cuda:0" if args.device == "cuda" else "the CPU", size))
    why = fc.spawn(check_reference, 1, (args.world, args, out_dir, precision == "bf16"))
    if why is None:
        fc.log("check: %d ranks, %s%s" % (args.world, fc.placement(args), (
            ", micro-batches of %d" % args.micro) if args.logical else ""))
        why = fc.spawn(check_rank, args.world, (
            args.world, os.path.join(out_dir, "init_check"), args, out_dir))
        if why is not None:
            why = "the ranks: " + why
    else:
        why = "the reference: " + why
    if why is not None:
        fc.log("check failed: %s" % why)
        print(json.dumps({"bench": "fsdp", "check": True, "passed": False, "error": why}),
              flush=True)
        return 1
    fc.log("check: comparing")
    ref = torch.load(os.path.join(out_dir, "reference.pt"))
    got = torch.load(os.path.join(out_dir, "check.pt"))
    res = compare(ref, got)
    kinds = set(got.get("held", {}).values())
    if sharded and len(kinds) > 1:  # every parameter should be a sharded f32 DTensor
        res["held_after_steps"] = {k: sorted(n for n, v in got["held"].items() if v == k)[:4]
                                   for k in sorted(kinds)}
    ok = res["max_tensor_l2_rel_diff"] <= tol and res["max_abs_update"] > 0
    print(json.dumps({
        "bench": "fsdp", "check": True, "model": args.model, "world": args.world,
        "batch_per_rank": size // args.world, "logical": args.logical,
        "micro": args.micro if args.logical else None, "seq": args.seq,
        "steps": CHECK_STEPS, "lr": CHECK_LR, "sigma": 0.0, "fully_shard": sharded,
        "precision": precision,
        **({"fault": os.environ["BENCH_FSDP_CHECK_FAULT"]}
           if os.environ.get("BENCH_FSDP_CHECK_FAULT") else {}),
        **{k: (round(v, 9) if isinstance(v, float) else v) for k, v in res.items()},
        "losses": [round(v, 6) for v in got["losses"]],
        "reference_losses": [round(v, 6) for v in ref["losses"]],
        "tolerance": tol, "passed": ok}), flush=True)
    return 0 if ok else 1
