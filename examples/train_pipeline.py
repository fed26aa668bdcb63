#!/usr/bin/python3
"""Train a small character-level transformer split into two pipeline stages,
one process each, with DP-SGD through dpclipd: flat clipping across the
stages, exactly as if the model were whole.

    /usr/bin/python3 examples/train_pipeline.py                # starts build/dpclipd itself
    /usr/bin/python3 examples/train_pipeline.py --socket /tmp/d.sock --epochs 3
    /usr/bin/python3 examples/train_pipeline.py --microbatches 8 --schedule gpipe
    /usr/bin/python3 examples/train_pipeline.py --daemons 2    # a GPU machine: one daemon per stage

Stage 0 (rank 0) holds the token and position embeddings and the first
blocks, stage 1 (rank 1) the last blocks, the final LayerNorm and the head.
Stage 0 draws the Poisson batches (the unit of privacy is one window of
--seq characters of the prose under examples/data/) and sends the targets,
then its activations, to stage 1, which computes the loss and sends their
gradients back: torch.distributed send/recv over gloo, on the CPU. Each
stage's engine is made with make_private(norm_group=...): the two form one
norm group in the daemon, which sums each sample's squared gradient norm
over both stages' layers before clipping to --clip, so the split model is
clipped exactly as the whole one; each stage's parameters get their noise
(--sigma) and the ledger charges the job once per step. Stage 0 prints the
loss, epsilon and tokens per second of each epoch.

Micro-batches: each Poisson batch (the logical batch, of expected size
--batch) is cut into --microbatches pieces that flow through the stages
under --schedule: "1f1b" (stage 0 runs one forward ahead, then each stage
alternates a forward and a backward: a stage holds at most two
micro-batches' activations) or "gpipe" (every forward, then every backward).
Each stage's forward pass of a micro-batch, once run backward, is one
micro-batch of the logical step its engine sends the daemon (dpclip's
gradient accumulation); the daemon sums each micro-batch's per-sample norms
over the two stages before clipping, and optimizer.step() after the
schedule commits the logical step: noised and charged once. Each
micro-batch's loss is its own mean. Activations and gradients go with
isend, which nothing waits on inside the schedule (a blocking send would
deadlock 1F1B), and a stage's engine never waits for a micro-batch's reply
before step() either, for the same reason.

Without --socket a daemon is started from this checkout's build/dpclipd
($DPCLIPD names another) on a temporary socket and stopped at the end.
With --daemons 2 each stage uses its own daemon, as stages on two nodes
would: the daemons exchange their stages' norms through NCCL (each needs a
GPU). Started here, both run on this machine's GPU with their own
NCCL_HOSTID, so that NCCL links them over its socket transport; --socket
A,B names two running daemons instead.
"""
import argparse
import datetime
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))  # run from a checkout
sys.path.insert(0, HERE)

# dpclip first: without torch it says which python3 has it
from dpclip.pipeline import schedule  # noqa: E402
from dpclip.torch import PrivacyEngine, sequence_cross_entropy  # noqa: E402
from dpclip.data import DPDataLoader  # noqa: E402
from train_transformer import Block, Windows, load_corpus  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402


class First(nn.Module):
    """Stage 0: tokens [B, T] -> hidden [B, T, d]."""

    def __init__(self, vocab, seq, d, blocks, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))

    def forward(self, x):
        B, T = x.shape
        pos = torch.arange(T).unsqueeze(0).expand(B, T)  # [B, T]: batch-first for dpclip
        h = self.tok(x) + self.pos(pos)
        for blk in self.blocks:
            h = blk(h)
        return h


class Last(nn.Module):
    """Stage 1: hidden [B, T, d] -> logits [B, T, vocab]."""

    def __init__(self, vocab, d, blocks, heads):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, h):
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def stage_main(rank, args, init_file, sockets):
    socket_path = sockets[rank % len(sockets)]
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        train(rank, args, socket_path)
    finally:
        dist.destroy_process_group()


def train(rank, args, socket_path):
    text = load_corpus(args.corpus)
    itos = sorted(set(text))
    stoi = {c: i for i, c in enumerate(itos)}
    ids = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    ds = Windows(ids[:int(0.9 * len(ids))], args.seq, args.stride)
    torch.manual_seed(args.seed)  # both stages cut from one model's initialisation
    first = First(len(itos), args.seq, args.d, args.blocks // 2, args.heads)
    last = Last(len(itos), args.d, args.blocks - args.blocks // 2, args.heads)
    stage = first if rank == 0 else last
    # Stage 0 loads the data; stage 1 takes its expected batch size and
    # sample rate from it (make_private agrees them over the group).
    loader = DPDataLoader(ds, sample_rate=args.batch / len(ds), distributed=False) \
        if rank == 0 else None
    engine = PrivacyEngine(socket_path, client_name="train_pipeline", job_id=args.job)
    stage, opt, loader = engine.make_private(
        module=stage, optimizer=torch.optim.Adam(stage.parameters(), lr=args.lr),
        data_loader=loader, noise_multiplier=args.sigma, max_grad_norm=args.clip,
        loss_reduction="mean", target_delta=args.delta, norm_group=dist.group.WORLD)
    if rank == 0:
        print("corpus %d chars, %d windows; stages of %d and %d params; daemon %s; norm group "
              "%s; DP-SGD sigma %.2f, C %.2f, expected batch %d in %d micro-batches (%s), "
              "%d steps/epoch"
              % (len(text), len(ds), sum(p.numel() for p in first.parameters()),
                 sum(p.numel() for p in last.parameters()),
                 engine.client.info.daemon_version.decode(), engine.norm_group_name, args.sigma,
                 args.clip, engine.expected_batch_size, args.microbatches, args.schedule,
                 len(loader)), flush=True)
    steps = 0
    for epoch in range(1, args.epochs + 1):
        t0, loss_sum, samples, tokens = time.time(), 0.0, 0, 0
        batches = iter(loader) if rank == 0 else None
        n_steps = len(loader) if rank == 0 else 0
        box = [min(n_steps, args.steps - steps) if args.steps else n_steps]
        dist.broadcast_object_list(box, src=0)  # stage 1 steps as often
        for _ in range(box[0]):
            # the logical batch's micro-batch sizes, from stage 0
            sizes = torch.zeros(args.microbatches + 1, dtype=torch.long)
            if rank == 0:
                x, y = next(batches)
                B = x.shape[0]
                parts = min(args.microbatches, B)
                sizes[0] = parts
                for i in range(parts):  # as equal as they come
                    sizes[1 + i] = B // parts + (1 if i < B % parts else 0)
                dist.send(sizes, 1)
                if parts:
                    dist.send(y.contiguous(), 1)
                tokens += x.numel()
            else:
                dist.recv(sizes, 0)
                parts = int(sizes[0])
                y = torch.empty(int(sizes[1:].sum()), args.seq, dtype=torch.long)
                if parts:
                    dist.recv(y, 0)
                x = None
            opt.zero_grad()
            # an empty Poisson batch runs nothing and still steps (noise alone)
            total, n = run_schedule(stage, rank, args, x, y, sizes[1:parts + 1].tolist())
            loss_sum += total
            samples += n
            opt.step()  # commits the logical step: waits in the daemon for the other stage's
            steps += 1
        box = [loss_sum, samples]
        dist.broadcast_object_list(box, src=1)
        if rank == 0:
            eps = engine.last_epsilon
            print("epoch %d: loss %.3f, epsilon %s, %.0f tokens/s" % (
                epoch, box[0] / max(box[1], 1),
                "%.2f" % eps if eps and math.isfinite(eps) else "inf",
                tokens / max(time.time() - t0, 1e-9)), flush=True)
        if args.steps and steps >= args.steps:
            break
    if rank == 0:
        print("privacy: epsilon %.2f at delta %.1e after %d steps (the daemon's ledger for job "
              "%s, charged once per step of the two stages)"
              % (engine.last_epsilon, engine.last_delta, steps, engine.job_id), flush=True)
    engine.close()


def run_schedule(stage, rank, args, x, y, sizes):
    """One logical batch's micro-batches through this stage in the
    schedule's order; (stage 1: the sum of the micro-batches' mean losses
    times their sizes, and the samples)."""
    at = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    sends, outs, ins, losses = [], {}, {}, {}
    total = 0.0
    for op, i in schedule(args.schedule, 2, rank, len(sizes)):
        part = slice(at[i], at[i + 1])
        if rank == 0 and op == "F":
            outs[i] = stage(x[part])
            h = outs[i].detach().contiguous()
            sends.append((dist.isend(h, 1), h))  # waited for after the schedule
        elif rank == 0:
            g = torch.empty(outs[i].shape)
            dist.recv(g, 1)
            outs.pop(i).backward(g)
        elif op == "F":
            h = torch.empty(sizes[i], args.seq, args.d)
            dist.recv(h, 0)
            ins[i] = h.requires_grad_(True)
            # each micro-batch's loss: the mean over its own samples
            losses[i] = sequence_cross_entropy(stage(ins[i]), y[part], reduction="mean")
        else:
            loss = losses.pop(i)
            loss.backward()
            total += float(loss) * sizes[i]
            g = ins.pop(i).grad.contiguous()
            sends.append((dist.isend(g, 0), g))
    for work, _ in sends:
        work.wait()
    return total, sum(sizes) if rank == 1 else 0


def start_daemon(rundir, k=0):
    """build/dpclipd (or $DPCLIPD) on a socket in rundir; returns (process,
    socket) once it reported READY. k: which of several on this machine."""
    exe = os.environ.get("DPCLIPD") or os.path.join(os.path.dirname(HERE), "build", "dpclipd")
    sock = os.path.join(rundir, "dpclipd%d.sock" % k)
    env = dict(os.environ, NCCL_HOSTID="train-pipeline-%d" % k, NCCL_NVLS_ENABLE="0")
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    r, w = os.pipe()
    proc = subprocess.Popen([exe, "--socket", sock, "--ready-fd", str(w), "--ledger-dir",
                             os.path.join(rundir, "ledger%d" % k), "--log-level", "warn"],
                            pass_fds=(w,), env=env)
    os.close(w)
    with os.fdopen(r) as f:
        if f.readline() != "READY\n":
            proc.kill()
            sys.exit("%s did not start" % exe)
    return proc, sock


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", default=None, help="a running dpclipd's socket, or two "
                    "(A,B: one per stage) (default: start build/dpclipd on a temporary one)")
    ap.add_argument("--daemons", type=int, choices=(1, 2), default=1,
                    help="daemons to start: 2 puts each stage on its own (NCCL, GPU)")
    ap.add_argument("--corpus", default=os.path.join(HERE, "data"))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: none)")
    ap.add_argument("--sigma", type=float, default=0.8, help="noise multiplier")
    ap.add_argument("--clip", type=float, default=1.0, help="max per-sample gradient norm C")
    ap.add_argument("--batch", type=int, default=32, help="expected (Poisson) batch size: the "
                    "logical batch")
    ap.add_argument("--microbatches", type=int, default=4,
                    help="micro-batches each logical batch is cut into (at most its size)")
    ap.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                    help="pipeline schedule of the micro-batches")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=4, help="transformer blocks, split in two")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per stage")
    ap.add_argument("--seed", type=int, default=0, help="model initialisation")
    ap.add_argument("--delta", type=float, default=1e-5, help="delta epsilon is reported at")
    ap.add_argument("--job", default=None, help="job id for the daemon's privacy ledger "
                    "(default: a fresh one, printed)")
    args = ap.parse_args()
    if args.microbatches < 1:
        ap.error("--microbatches must be at least 1")
    if len(args.socket.split(",")) == 2 if args.socket else args.daemons == 2:
        # two daemons exchange their stages' norms through NCCL, between GPUs
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            ap.error("two daemons (--daemons 2, or --socket A,B) exchange norms through NCCL "
                     "and need a GPU for each stage; this machine has none: use --daemons 1")
    with tempfile.TemporaryDirectory(prefix="dpclip-pipeline.") as rundir:
        daemons, sockets = [], args.socket.split(",") if args.socket else []
        try:
            for k in range(0 if sockets else args.daemons):
                proc, sock = start_daemon(rundir, k)
                daemons.append(proc)
                sockets.append(sock)
            mp.start_processes(stage_main, args=(args, os.path.join(rundir, "init"), sockets),
                               nprocs=2, start_method="spawn")
        finally:
            for proc in daemons:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
