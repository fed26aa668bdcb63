#!/usr/bin/python3
"""Train a small character-level transformer split into two pipeline stages,
one process each, with DP-SGD through dpclipd: flat clipping across the
stages, exactly as if the model were whole.

    /usr/bin/python3 examples/train_pipeline.py                 # starts build/dpclipd itself
    /usr/bin/python3 examples/train_pipeline.py --socket /tmp/d.sock --epochs 3
    /usr/bin/python3 examples/train_pipeline.py --daemons 2     # a GPU machine: one daemon per stage

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
              "%s; DP-SGD sigma %.2f, C %.2f, expected batch %d, %d steps/epoch"
              % (len(text), len(ds), sum(p.numel() for p in first.parameters()),
                 sum(p.numel() for p in last.parameters()),
                 engine.client.info.daemon_version.decode(), engine.norm_group_name, args.sigma,
                 args.clip, engine.expected_batch_size, len(loader)), flush=True)
    steps = 0
    for epoch in range(1, args.epochs + 1):
        t0, loss_sum, samples, tokens = time.time(), 0.0, 0, 0
        batches = iter(loader) if rank == 0 else None
        n_steps = len(loader) if rank == 0 else 0
        box = [min(n_steps, args.steps - steps) if args.steps else n_steps]
        dist.broadcast_object_list(box, src=0)  # stage 1 steps as often
        for _ in range(box[0]):
            B = torch.zeros(1, dtype=torch.long)
            opt.zero_grad()
            if rank == 0:
                x, y = next(batches)
                B[0] = x.shape[0]
                dist.send(B, 1)
                if B[0] > 0:  # an empty Poisson batch still steps (noise alone)
                    dist.send(y.contiguous(), 1)
                    h = stage(x)
                    dist.send(h.detach().contiguous(), 1)
                    g = torch.empty_like(h)
                    dist.recv(g, 1)
                    h.backward(g)
                    tokens += x.numel()
            else:
                dist.recv(B, 0)
                if B[0] > 0:
                    y = torch.empty(int(B[0]), args.seq, dtype=torch.long)
                    dist.recv(y, 0)
                    h = torch.empty(int(B[0]), args.seq, args.d)
                    dist.recv(h, 0)
                    h.requires_grad_(True)
                    loss = sequence_cross_entropy(stage(h), y, reduction="mean")
                    loss.backward()
                    dist.send(h.grad.contiguous(), 0)
                    loss_sum += float(loss) * int(B[0])
                    samples += int(B[0])
            opt.step()  # waits in the daemon for the other stage's step
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
    ap.add_argument("--batch", type=int, default=32, help="expected (Poisson) batch size")
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
