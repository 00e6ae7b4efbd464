"""Train a small character-level GPT on 2 ranks with torch_autopar.

    torchrun --nproc-per-node 2 examples/train_gpt.py                 # eager mode (PyNative)
    torchrun --nproc-per-node 2 examples/train_gpt.py --mode graph    # torch.compile through "autopar"

The corpus is the Zen of Python (shipped with every Python, so the run is offline), cut into windows of
``--block-size`` characters whose target is the same window shifted by one character. The model is written for
one device; ``autopar.compile`` plans it for the job's ranks (data parallel here) and ``autopar.Model`` shards
the windows by rank, shows a progress bar with the running loss and returns per-epoch metrics. Also runs as a
single process (``python examples/train_gpt.py``): the plan is then ``stand_alone``.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()

import argparse  # noqa: E402
import codecs  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402

import torch_autopar as autopar  # noqa: E402
from torch_autopar.testing.models import GPT, GPTConfig, gpt2_init, gpt_loss  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--mode", choices=autopar.runtime.modes.MODES, default=None,
                        help="execution mode (default: $AUTOPAR_MODE, else eager)")
    parser.add_argument("--strategy", default="auto", help="autopar.compile strategy (auto, data_parallel, ...)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps-per-epoch", type=int, default=40,
                        help="optimizer steps per epoch; the dataset holds steps-per-epoch x batch-size windows")
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (windows per step, all ranks)")
    parser.add_argument("--block-size", type=int, default=64, help="characters per window")
    parser.add_argument("--n-layer", type=int, default=3)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (ranks share the cores)")
    parser.add_argument("--prompt", default="Beautiful is")
    parser.add_argument("--sample-chars", type=int, default=160, help="characters to decode greedily at the end")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    return parser.parse_args()


def quiet_warnings() -> None:
    """Library chatter that says nothing about this run (deprecations inside torch, gloo's CPU notes)."""
    for category in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
    warnings.filterwarnings("ignore", message=".*torch._dynamo.*")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def zen_of_python() -> str:
    """The Zen of Python; ``import this`` prints it, so the print is swallowed and the text decoded directly."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


class CharWindows(torch.utils.data.Dataset):
    """``count`` windows over the text read as a ring: item i starts at character i mod len(text)."""

    def __init__(self, text: str, block_size: int, count: int):
        self.vocab = sorted(set(text))
        self.index = {ch: i for i, ch in enumerate(self.vocab)}
        ids = torch.tensor(self.encode(text), dtype=torch.long)
        self.ring = torch.cat([ids, ids[:block_size + 1]])   # wrap around: every start has a full window
        self.length, self.block_size, self.count = len(ids), block_size, count

    def encode(self, text: str) -> list[int]:
        return [self.index[ch] for ch in text]

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        start = i % self.length
        chunk = self.ring[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@torch.no_grad()
def greedy_sample(model: torch.nn.Module, data: CharWindows, prompt: str, chars: int) -> str:
    """Greedy decoding on this rank's copy of the (trained, replicated) model."""
    model.eval()
    ids = data.encode(prompt)
    for _ in range(chars):
        context = torch.tensor([ids[-data.block_size:]])
        ids.append(int(model(context)[0, -1].argmax()))
    model.train()
    return data.decode(ids)


@torch.no_grad()
def replica_divergence(model: torch.nn.Module) -> float:
    """Largest |parameter - rank 0's parameter| over all ranks: 0 when data parallelism kept replicas in step."""
    if not torch.distributed.is_initialized():
        return 0.0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    torch.distributed.broadcast(reference, src=0)
    worst = (flat - reference).abs().max().reshape(1)
    torch.distributed.all_reduce(worst, op=torch.distributed.ReduceOp.MAX)
    return float(worst)


def main() -> None:
    args = parse_args()
    quiet_warnings()
    torch.set_num_threads(args.threads)
    autopar.init()
    rank, world = autopar.get_rank(), autopar.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    text = zen_of_python()
    data = CharWindows(text, args.block_size, args.steps_per_epoch * args.batch_size)
    config = GPTConfig(vocab_size=len(data.vocab), block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(args.seed)   # autopar broadcasts rank 0's parameters anyway
    model = GPT(config)
    gpt2_init(model)
    say(f"corpus: the Zen of Python, {len(text)} characters, vocabulary {len(data.vocab)}; {len(data)} windows "
        f"of {args.block_size} per epoch")
    say(f"model: GPT {args.n_layer} layers x {args.n_embd} wide, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters; {world} rank(s), global batch {args.batch_size}, mode {args.mode or autopar.get_mode()}")

    local_batch = args.batch_size // world
    example = (torch.zeros(local_batch, args.block_size, dtype=torch.long),)   # what this rank will pass
    pmodel = autopar.compile(model, example_inputs=example, mode=args.mode, strategy=args.strategy)
    say(pmodel.plan.explain())

    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr, weight_decay=0.01)
    trainer = autopar.Model(pmodel, gpt_loss, optimizer)
    trained = time.perf_counter()
    metrics = trainer.train(args.epochs, data, batch_size=args.batch_size, seed=args.seed,
                            progress=not args.no_progress)
    training_s = time.perf_counter() - trained

    say("\nepoch   loss     samples/s   seconds")
    for m in metrics:
        say(f"{m['epoch']:>5}  {m['loss']:7.4f}  {m['samples_per_s']:9.1f}  {m['seconds']:8.2f}")
    samples = sum(m["samples"] for m in metrics)
    say(f"loss {metrics[0]['loss']:.4f} -> {metrics[-1]['loss']:.4f} (uniform guess: "
        f"{torch.log(torch.tensor(float(len(data.vocab)))):.4f})")
    say(f"throughput: {metrics[-1]['samples_per_s']:.1f} samples/s in the last epoch, {samples / training_s:.1f} "
        f"samples/s over training ({samples} samples, {training_s:.1f} s, first step includes "
        f"{'graph compilation' if (args.mode or autopar.get_mode()) == 'graph' else 'warm-up'})")
    divergence = replica_divergence(pmodel.module)
    say(f"replicas after training: max |param - rank 0's| = {divergence:.3g} "
        + ("(in step)" if divergence <= 1e-6 else "(DIVERGED: gradients were not averaged over ranks)"))
    if rank == 0:
        sample = greedy_sample(pmodel.module, data, args.prompt, args.sample_chars)
        print(f"greedy sample (prompt {args.prompt!r}):\n---\n{sample}\n---")
    say(f"wall time: {time.perf_counter() - STARTED:.1f} s (this rank, from interpreter start of the script)")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    if divergence > 1e-6:
        raise SystemExit(f"torch_autopar: the {world} model replicas differ after training (max difference "
                         f"{divergence:.3g}); plan {pmodel.plan.strategy!r} did not synchronise gradients.")


if __name__ == "__main__":
    main()
