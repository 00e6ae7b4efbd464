"""Helpers shared by the tests: outcomes of calls that may raise, models and data, a one-process reference.

Functions used inside ``run_on_ranks`` must be importable by module name (spawned ranks import this module).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import torch_autopar as autopar
from torch_autopar import _compat
from torch_autopar.capture.program import tensor_nbytes
from torch_autopar.runtime.comm_count import CollectiveCounter, planned_summary
from torch_autopar.testing.models import GPT, MLP, Llama, LlamaConfig, SmallCNN, gpt_loss

STEPS = 3
GLOBAL_BATCH = 8


def by_case(results: list[dict]) -> dict:
    """Per-rank results of a job that returns {case: outcome} → {case: [each rank's outcome]}."""
    return {key: [result[key] for result in results] for key in results[0]}


def outcome(fn, *args, **kwargs) -> tuple[str, object]:
    """("ok", value) or (exception type name, message): picklable, so ranks can report errors as data."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as error:  # reported, then asserted on by the test
        return type(error).__name__, str(error)


def assert_ranks_equal_one_process(outcomes: list, reference: tuple, what: str) -> dict:
    """``outcomes``: each rank's ``outcome`` of a run returning {"losses": [...], "params": {...}};
    ``reference``: (losses, params) of one process. The mean loss over ranks of every step and each rank's full
    parameters must equal the reference. Returns rank 0's run."""
    ref_losses, ref_params = reference
    for rank, (status, run) in enumerate(outcomes):
        assert status == "ok", f"rank {rank} {what}: {status}: {run}"
    runs = [run for _, run in outcomes]
    mean = [sum(run["losses"][s] for run in runs) / len(runs) for s in range(len(ref_losses))]
    assert_losses_close(mean, ref_losses, what=what)
    for rank, run in enumerate(runs):
        assert_params_close(run["params"], ref_params, what=f"rank {rank} {what}")
    return runs[0]


def assert_autopar_error(result, *fragments) -> None:
    """``result`` (an ``outcome``) is an AutoparError whose message starts with "torch_autopar:" and names each
    fragment."""
    kind, message = result
    assert kind == "AutoparError", f"expected an AutoparError, got {kind}: {message}"
    assert message.startswith("torch_autopar:"), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def build_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "uneven":  # widths that do not divide by 4 ranks: 10 hidden units, 6 outputs
        return MLP((12, 10, 6))
    if name == "blocks":
        return StackedMLP()
    if name == "llama":  # grouped-query attention: 2 key/value heads for 4 query heads
        return Llama(LlamaConfig(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=96))
    return {"mlp": MLP, "gpt": GPT, "gpt_head": AliasedHeadGPT, "branchy": Branchy, "straight": Straight,
            "cnn": SmallCNN}[name]()


def global_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (inputs, targets) of training step ``step`` for model ``name``: same on every rank."""
    generator = torch.Generator().manual_seed(1000 + step)
    if name in ("gpt", "gpt_head", "llama"):
        tokens = torch.randint(0, 96, (GLOBAL_BATCH, 17), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]
    if name == "cnn":
        return torch.randn(GLOBAL_BATCH, 3, 8, 8, generator=generator), torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)
    if name == "uneven":
        return torch.randn(GLOBAL_BATCH, 12, generator=generator), torch.randn(GLOBAL_BATCH, 6, generator=generator)
    if name in ("branchy", "straight"):
        x = torch.randn(GLOBAL_BATCH, 8, generator=generator).abs()
        return (x if step % 2 == 0 else -x), torch.randn(GLOBAL_BATCH, 4, generator=generator)
    return torch.randn(GLOBAL_BATCH, 32, generator=generator), torch.randn(GLOBAL_BATCH, 8, generator=generator)


def loss_fn(name: str, output, target):
    if name == "cnn":
        return F.cross_entropy(output, target)
    return gpt_loss(output, target) if name in ("gpt", "gpt_head", "llama") else F.mse_loss(output, target)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_steps(module: nn.Module, model_name: str, optimizer, rank: int = 0, world: int = 1) -> list[float]:
    """``STEPS`` optimizer steps; each rank passes its slice ``global.chunk(world)[rank]``. Returns the losses."""
    losses = []
    for step in range(STEPS):
        x, y = global_batch(model_name, step)
        loss = loss_fn(model_name, module(x.chunk(world)[rank]), y.chunk(world)[rank])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def train_language_model(module: nn.Module, batches, rank: int = 0, world: int = 1, steps: int = 3) -> list[float]:
    """``steps`` AdamW steps of ``gpt_loss`` with each batch of tokens as its own targets, on this rank's slice of
    ``batches(step)``: the losses."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(steps):
        x = batches(step).chunk(world)[rank]
        optimizer.zero_grad(set_to_none=True)
        loss = gpt_loss(module(x), x)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _graph_forward_collectives(pmodel) -> Counter:
    names = {_compat.group_name(pmodel.mesh.get_group(i)): n for i, n in enumerate(pmodel.mesh.mesh_dim_names)}
    forward = pmodel.stats["graph_collectives"]["forward"]
    check = next(c for c in pmodel.plan.collectives if c.where.endswith("check"))  # the input check, outside the graph
    return (Counter((kind, names.get(group, group), nbytes) for kind, group, nbytes in forward)
            + Counter([(check.kind, check.axis, check.nbytes)]))


def counted_step(pmodel, model_name: str, optimizer, x, y, mode: str):
    """One training step of a compiled module; returns (loss, Counter of (kind, mesh axis, bytes) of the
    collectives that ran). Graph mode: the forward graph's collectives are read from the compiled graph (a
    dispatch mode cannot run inside torch.compile), backward is counted."""
    optimizer.zero_grad(set_to_none=True)
    sharded = pmodel.mesh is not None
    counter = CollectiveCounter(pmodel.mesh) if sharded else None
    if mode == "eager" and sharded:
        with counter:
            loss = loss_fn(model_name, pmodel(x), y)
            loss.backward()
        counted = counter.summary()
    else:
        loss = loss_fn(model_name, pmodel(x), y)
        if sharded:
            with counter:
                loss.backward()
            counted = counter.summary() + _graph_forward_collectives(pmodel)
        else:
            loss.backward()
            counted = Counter()
    optimizer.step()
    return loss.item(), counted


def counted_training(pmodel, model: nn.Module, model_name: str, rank: int, world: int, mode: str,
                     optimizer_name: str = "adamw") -> dict:
    """``STEPS`` steps of a compiled module on this rank's slices, each counted (``counted_step``): the losses,
    the full parameters after them, each step's collectives and the plan's (``planned_summary``)."""
    optimizer = make_optimizer(optimizer_name, pmodel.parameters())
    losses, counts = [], []
    for step in range(STEPS):
        x, y = global_batch(model_name, step)
        loss, counted = counted_step(pmodel, model_name, optimizer, x.chunk(world)[rank], y.chunk(world)[rank], mode)
        losses.append(loss)
        counts.append(dict(counted))
    state = pmodel.state_dict()
    return {"losses": losses, "params": {name: state[name].clone() for name, _ in model.named_parameters()},
            "counted": counts, "planned": dict(planned_summary(pmodel.plan))}


def megatron_plan(model, global_x, mesh, full_batch: bool = False):
    """A hand plan: first linear of each MLP block column-parallel on the last mesh axis (weight and bias
    S(0)), second row-parallel (weight S(1), bias replicated), everything else replicated; on a 2-D mesh the
    batch is split over the first axis, on a 1-D mesh every rank computes the whole batch."""
    plan = autopar.plan(model, (global_x,), mesh_shape=mesh, strategy="data_parallel", hardware="cpu-gloo",
                        full_batch=full_batch)
    column = ("layers.0.", "fc.")
    row = ("layers.1.weight", "out.weight")
    lead = ("R",) * (len(mesh) - 1)
    for name in plan.param_placements:
        tail = name.split("blocks.")[-1].split(".", 1)[-1] if "blocks." in name else name
        plan.param_placements[name] = lead + (("S(0)",) if tail.startswith(column) else ("S(1)",) if tail in row
                                              else ("R",))
    plan.input_placements = {0: ("S(0)", "R") if len(mesh) == 2 else ("R",)}
    plan.strategy = "megatron (hand plan)"
    return plan


def params_of(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def reference_run(model_name: str, optimizer_name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process run every parallel run must reproduce: plain PyTorch on the whole global batch."""
    model = build_model(model_name)
    losses = train_steps(model, model_name, make_optimizer(optimizer_name, model.parameters()))
    return losses, params_of(model)


def assert_losses_close(actual: list[float], expected: list[float], rel: float = 1e-5, what: str = "") -> None:
    assert len(actual) == len(expected), what
    for step, (a, e) in enumerate(zip(actual, expected)):
        assert abs(a - e) <= rel * abs(e), f"{what} step {step}: loss {a!r} vs {e!r} (rel {abs(a - e) / abs(e):.2e})"


def assert_params_close(actual: dict, expected: dict, what: str = "") -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what} {name}: {m}")


class Branchy(nn.Module):
    """Data-dependent Python control flow: the branch taken depends on the values of the input."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if x.sum() > 0:
            h = torch.relu(h)
        else:
            h = torch.tanh(h)
        return self.b(h)


class Straight(Branchy):
    """Same parameters as ``Branchy`` (so the same plan fingerprint), no data-dependent branch."""

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class BatchNormNet(nn.Module):
    """A model with buffers (batch-norm running statistics, one of them an integer counter)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def batch_norm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator) * (step + 1)
    return x, torch.randn(GLOBAL_BATCH, 2, generator=generator)


def full(tensor):
    """The full (unsharded) value of a tensor or DTensor (a collective for DTensors: call on every rank)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class AliasedHeadGPT(GPT):
    """The GPT with its output head an ``nn.Linear`` whose weight IS the token embedding's (``head.weight =
    tok.weight``, as nanoGPT and transformers tie them): one parameter under two names."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(self.config.n_embd, self.config.vocab_size, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class StackedMLP(nn.Module):
    """An input layer, an nn.ModuleList of residual MLP blocks (``widths``: each block's hidden width; equal
    widths make identical blocks) and a head: the pipeline tests' model of identical or unequal blocks."""

    def __init__(self, widths=(64, 64, 64, 64), dim: int = 32, out: int = 8):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, w), nn.ReLU(), nn.Linear(w, dim)) for w in widths)
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(torch.relu(x))


def regathered(graph) -> Counter:
    """The parameter gathers the partitioner runs again in backward (``rewrite.reshard``): those tagged for
    recomputation whose value (through other tagged nodes) both a forward op and a backward op (one that depends
    on a tangent) read; one read by backward alone runs there once."""
    backward = set(n for n in graph.graph.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    for node in graph.graph.nodes:
        if any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
    tagged = lambda n: "recompute" in n.meta  # noqa: E731

    def readers(node) -> set:
        found = set()
        for user in node.users:
            found |= readers(user) if tagged(user) else {user}
        return found

    counts = Counter()
    for node in graph.graph.find_nodes(op="call_function", target=_compat.functional_all_gather()):
        read = readers(node)
        if tagged(node) and read & backward and read - backward:
            counts[("all_gather", tensor_nbytes(node.meta["val"]))] += 1
    return counts
