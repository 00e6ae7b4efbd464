# %% [markdown]
# # Debugging a compiled model in eager mode
#
# `autopar.compile` runs in one of two modes with the same numbers:
#
# * **eager** (PyNative, the default): your Python `forward` runs op by op, so `print`, `breakpoint()` and
#   any debugger work inside it, even though the model was planned and runs through torch_autopar;
# * **graph**: `forward` is captured by `torch.compile` (backend `"autopar"`) and run as one graph.
#
# Develop and debug in eager, train in graph. Run this file top to bottom (`python
# examples/eager_debugging.py`) or cell by cell (`# %%` markers: VS Code, Jupytext, Spyder). It also runs
# under `torchrun --nproc-per-node 2`; then only rank 0 prints.

# %%
import warnings

import torch
import torch.nn as nn

import torch_autopar as autopar

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
torch.set_num_threads(1)
autopar.init()                       # a no-op outside torchrun
RANK = autopar.get_rank()
say = print if RANK == 0 else (lambda *args, **kwargs: None)


class Classifier(nn.Module):
    """A small MLP classifier whose forward can report what flows through it."""

    def __init__(self, width: int = 64, classes: int = 4):
        super().__init__()
        self.hidden = nn.Linear(16, width)
        self.head = nn.Linear(width, classes)
        self.debug = False

    def forward(self, x):
        h = torch.relu(self.hidden(x))
        if self.debug:               # plain Python: runs as written in eager mode
            dead = (h == 0).float().mean().item()
            say(f"  [forward] x {tuple(x.shape)} mean {x.mean():+.3f} std {x.std():.3f} | "
                f"hidden {tuple(h.shape)} max {h.max():.3f}, {dead:.0%} dead ReLUs")
        return self.head(h)


torch.manual_seed(0)
x = torch.randn(8, 16)
y = torch.randint(0, 4, (8,))
net = Classifier()
model = autopar.compile(net, example_inputs=(x,))
loss_fn = nn.CrossEntropyLoss()
say(f"plan: {model.plan.strategy}, mode: {autopar.get_mode()}")

# %% [markdown]
# ## 1. Eager mode: prints inside `forward` run during the compiled model's execution

# %%
net.debug = True
with autopar.mode("eager"):
    eager_loss = loss_fn(model(x), y)
    eager_loss.backward()
say(f"eager loss {eager_loss.item():.6f}; gradient norm of hidden.weight {net.hidden.weight.grad.norm():.6f}")
eager_grad = net.hidden.weight.grad.clone()
net.zero_grad()

# %% [markdown]
# ## 2. Graph mode: same module, same loss and gradients
#
# The debug print calls `.item()`, which reads a tensor value while tracing: graph mode would break the graph
# there (section 3 shows what that means), so switch the print off to compare one compiled graph with eager.

# %%
net.debug = False
with autopar.mode("graph"):
    graph_loss = loss_fn(model(x), y)
    graph_loss.backward()
say(f"graph loss {graph_loss.item():.6f}; gradient norm of hidden.weight {net.hidden.weight.grad.norm():.6f}")
say(f"same loss: {torch.equal(eager_loss, graph_loss)}, same gradients: "
    f"{torch.allclose(eager_grad, net.hidden.weight.grad, rtol=1e-6, atol=1e-7)}")
net.zero_grad()

# %% [markdown]
# ## 3. A branch on tensor values: fine in eager, in pieces in graph mode, refused by sharded plans
#
# `if h.mean() > 0.5:` needs the value of a tensor to choose the Python path. Eager mode just runs it. Graph
# mode under data parallelism (and in one process) runs it as `torch.compile` does: compiled pieces with the
# Python branch in between. A sharded strategy needs the whole forward as one graph, so it refuses with a
# `torch_autopar:` error naming dynamo's reason and the line.
#
# Planning traces `forward` too (on fake tensors, to see every op). Where it cannot plan a forward with such a
# branch, a plan made for the branch-free twin (`torch.where`) serves: a plan only depends on the parameters'
# names, shapes and dtypes.


# %%
class Gated(Classifier):
    def forward(self, x):
        h = torch.relu(self.hidden(x))
        if h.mean() > 0.5:           # data-dependent control flow
            h = h * 0.5
        return self.head(h)


class GatedWhere(Classifier):
    def forward(self, x):
        h = torch.relu(self.hidden(x))
        h = torch.where(h.mean() > 0.5, h * 0.5, h)
        return self.head(h)


torch.manual_seed(0)
try:
    gated = autopar.compile(Gated(), example_inputs=(x,))
    say("planned the branchy forward directly")
except Exception as error:       # noqa: BLE001 - shown, then worked around
    say(f"planning the branchy forward failed ({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
        "using the plan of its torch.where twin")
    torch.manual_seed(0)
    twin_plan = autopar.compile(GatedWhere(), example_inputs=(x,)).plan
    torch.manual_seed(0)
    gated = autopar.compile(Gated(), strategy=twin_plan)
with autopar.mode("eager"):
    say(f"eager: loss {loss_fn(gated(x), y).item():.6f}")
with autopar.mode("graph"):
    say(f"graph (compiled pieces): loss {loss_fn(gated(x), y).item():.6f}")
try:
    autopar.compile(Gated(), example_inputs=(x,), strategy="fully_shard")
except autopar.AutoparError as error:
    say(f"fully_shard: AutoparError\n  {error}")

# %% [markdown]
# The fix it suggests for a sharded plan: express the branch without Python control flow, as `GatedWhere` does
# (or guard debugging code with `if not torch.compiler.is_compiling():`); then every strategy captures it and
# both modes agree:

# %%
torch.manual_seed(0)
gated_where = autopar.compile(GatedWhere(), example_inputs=(x,))
with autopar.mode("eager"):
    eager_where = loss_fn(gated_where(x), y).item()
with autopar.mode("graph"):
    graph_where = loss_fn(gated_where(x), y).item()
say(f"torch.where version: eager loss {eager_where:.6f}, graph loss {graph_where:.6f}")
