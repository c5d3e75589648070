"""The `flowmesh` command line: every command's arguments, options and help, and a parser
stricter than argparse's. The commands themselves are `client_sdk/cli.py`'s."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from client_sdk import demo_options
from client_sdk.client import DEFAULT_ADDRESS
from flowmesh.auth import ROLES
from gateway.__main__ import add_options as gateway_options

Command = Callable[[argparse.Namespace], int]

SWEEP_HELP = """Run a hyper-parameter sweep described by a TOML file (scripts/sweep_example.toml):
trials are training jobs on the mesh, driven by Optuna (ask-and-tell) and pruned early by its
successive-halving or Hyperband pruner; a live table on stderr, the results table on stdout, and
trials.json + curves.png in the output directory.

Top-level keys: name (study; jobs are <name>-t<N>), factory (module:callable) or hf (a Hugging
Face model directory the workers can read: every trial starts from its weights, the space holds
optimizer settings only), trials, steps,
eval_every (steps between held-out evaluations, each reported to the pruner), concurrency
(trials at once, default 2), pruner (successive_halving | hyperband | none), reduction_factor
(default 3), objective (loss | accuracy; default loss), direction (minimize | maximize; default
by objective), batch (rows per step, default 16), loss (cross_entropy | mse), seed (sampler and
initial weights, default 0), chunk_bytes (e.g. "32KiB"), pipeline (each trial's job over that
many workers, or "auto": the broker's choice; default 0: one), out (output directory, default
sweep-<name>).
Tables: [kwargs] fixed factory keyword arguments; [optimizer] fixed optimizer (name, lr, ...;
default adamw, lr 1e-3); [data] file / eval_file (a .safetensors file with 'inputs' and
'targets'; any other file is a text corpus for next-byte prediction, in windows of 32 bytes), or
the built-in synthetic dataset: samples (default 512), seq (16), seed (0); holdout (fraction of
the rows held out for evaluation when there is no eval_file, default 0.2); [space.<param>]
type = "float" | "int" | "categorical" with low, high, log, step or choices. A <param> named
optimizer, lr, weight_decay, momentum or optim.<key> sets the optimizer; any other name is a
factory keyword argument. Relative paths are relative to the TOML file's directory.
With --storage, several drivers (on one mesh or several) given the same name share one study:
trials counts its finished trials, whoever ran them, and a dead driver's running trials are
failed and retried by the others (heartbeats every --heartbeat s, --grace s of silence)."""


class Parser(argparse.ArgumentParser):
    """argparse, stricter: no abbreviated flags (`--batc` is not `--batch`; a flag added later
    must not change what an old command line means), and an unknown argument is refused by the
    (sub)command it was given to, with that command's usage and the closest flag it has."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(self.unknown(extra))
        return ns, extra

    def unknown(self, extra: list[str]) -> str:
        msg = f"unrecognized arguments: {' '.join(extra)}"
        flags = [f for a in self._actions for f in a.option_strings if f.startswith("--")]
        for arg in extra:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.partition("=")[0], flags, n=1)
                if close:
                    return f"{msg} (did you mean {close[0]}?)"
        return msg


def pipeline_arg(text: Any) -> int | str:
    """`--pipeline`'s value (and a sweep config's `pipeline`): a number of stages, or "auto"."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    if isinstance(text, bool) or not isinstance(text, int | str):  # TOML's true, 2.5
        raise argparse.ArgumentTypeError(f"pipeline {text!r}: a number of stages, or auto")
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"pipeline {text!r}: a number of stages, or auto"
        ) from None
    if not 0 <= n <= 64:
        raise argparse.ArgumentTypeError(f"pipeline {n}: between 0 and 64 stages, or auto")
    return n


def seconds_arg(text: str) -> float:
    """argparse's type= for a number of seconds over 0 (a broker refuses 0: no peer could
    register, and its loop would spin)."""
    value = float(text)
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"expected a number over 0, got {text!r}")
    return value


def count_arg(text: str) -> int:
    """argparse's type= for a count of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("flowmesh")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser(commands: Mapping[str, Command], description: str) -> argparse.ArgumentParser:
    """The `flowmesh` command line; each (sub)command runs its function in `commands`, by
    name ('keys add' for a subcommand of a subcommand)."""
    ap = Parser(prog="flowmesh", description=description, allow_abbrev=False)
    ap.add_argument("--version", action="version", version=f"flowmesh {version()}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def add(subs: Any, name: str, help_: str) -> argparse.ArgumentParser:
        # add_parser does not pass the parent's allow_abbrev on: say it for each one.
        p: argparse.ArgumentParser = subs.add_parser(name, help=help_, allow_abbrev=False)
        return p

    def client_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        p = add(sub, name, help_)
        p.add_argument(
            "--broker", default=DEFAULT_ADDRESS, help="broker client endpoint (env FLOWMESH_BROKER)"
        )
        p.add_argument("--timeout", type=seconds_arg, default=60.0, help="seconds (60)")
        p.add_argument(
            "--keys",
            default=None,
            help="CURVE key of this client, a NAME.key_secret file with broker.key next to it "
            "(env FLOWMESH_KEYS)",
        )
        return p

    p = add(sub, "up", "run broker, partitioner and workers on this machine")
    p.add_argument(
        "--cpu-workers",
        type=int,
        default=0,
        help="CPU stand-in workers instead of one worker per GPU",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        help="device budget per worker (CPU stand-ins: 1GiB; GPUs: 80%% of free)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:5555", help="host:port for clients; workers join on port+1"
    )
    p.add_argument(
        "--heartbeat", type=seconds_arg, default=1.0, help="seconds between heartbeats (1)"
    )
    p.add_argument("--threads", type=count_arg, default=None, help="torch threads per worker")
    p.add_argument(
        "--train-bytes",
        default=None,
        help="device bytes per worker for training jobs, besides --memory-budget (default: none)",
    )
    p.add_argument(
        "--allow",
        action="append",
        default=None,
        metavar="MODULE",
        help="module allowed to provide model and loss factories, for the whole mesh "
        "(repeatable; default: flowmesh.examples and torch.nn)",
    )
    p.add_argument(
        "--keys",
        default=None,
        help="key directory (flowmesh keys init): CURVE everywhere; the keys of the processes "
        "'up' starts are added to it",
    )
    p.add_argument(
        "--data-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory under which clients may name weights files, Hugging Face directories "
        "and checkpoints to resume (repeatable; default: the working directory)",
    )
    p.add_argument(
        "--checkpoint-root",
        action="append",
        default=None,
        metavar="DIR",
        help="a directory under which clients save training checkpoints and resume from them "
        "(repeatable; default: the working directory)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="without --keys, let --listen be a non-loopback address anyway: anyone who reaches "
        "it may deploy, train, register as a worker and read every answer (default: refused)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Prometheus /metrics: the broker on this port, the partitioner on the next, "
        "worker i on port+2+i (default: off)",
    )
    p.add_argument(
        "--state-dir",
        default=None,
        help="the broker keeps its models, plans, jobs and allow-list here (SQLite), so that a "
        "restarted broker loses nothing (default: in memory only)",
    )
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="add a replica of a model its replicas cannot keep up with, and remove it once the "
        "model cools (never below the deployed count; default: off)",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="PORT",
        help="also run the HTTP gateway (OpenAI and KServe v2 routes) on this port, bound on "
        "127.0.0.1 unless the config's [gateway] table says host = ...; a config file with a "
        "[gateway] table starts it on that table's port (default 8000) without this flag",
    )
    p.add_argument(
        "--http-host",
        default=None,
        metavar="ADDRESS",
        help="the address the gateway binds (default: the config's [gateway] host, else "
        "127.0.0.1); any other than loopback needs API keys (flowmesh keys add NAME --role "
        "client --api, in the --keys directory) or --insecure",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML file with [broker], [partitioner] and [worker] tables, read by each process "
        "'up' starts as by 'python -m broker --config FILE'; what 'up' sets itself (addresses, "
        "budgets, heartbeat, names, roots, keys) wins over the file",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="the processes' logs go here, and stay (default: a temporary directory, removed "
        "when 'up' stops unless something failed)",
    )
    p.set_defaults(fn=commands["up"])

    p = add(sub, "keys", "CURVE keys: a broker key pair, then one key per peer")
    keys_sub = p.add_subparsers(dest="keys_cmd", required=True)
    k = add(keys_sub, "init", "create DIR and the broker's key pair in it")
    k.add_argument("dir")
    k.set_defaults(fn=commands["keys init"])
    k = add(keys_sub, "add", "create (and so allow) the key of a peer or client")
    k.add_argument("name", help="the name it is allowed (a worker's or partitioner's --name)")
    k.add_argument("--role", required=True, choices=ROLES)
    k.add_argument("--dir", default=None, help="the key directory (env FLOWMESH_KEY_DIR)")
    k.add_argument(
        "--api",
        action="store_true",
        help="an API key for the HTTP gateway (role client or operator) in DIR/api_keys.json, "
        "printed once on stdout, instead of a CURVE key pair",
    )
    k.set_defaults(fn=commands["keys add"])
    k = add(keys_sub, "list", "the keys a key directory allows (CURVE keys and API keys)")
    k.add_argument("dir")
    k.set_defaults(fn=commands["keys list"])
    k = add(keys_sub, "remove", "revoke a key: a running broker or gateway refuses it at once")
    k.add_argument("name")
    k.add_argument("--dir", default=None, help="the key directory (env FLOWMESH_KEY_DIR)")
    k.add_argument("--api", action="store_true", help="an API key (DIR/api_keys.json)")
    k.set_defaults(fn=commands["keys remove"])

    p = client_cmd("jobs", "show training jobs (or close one)")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--close",
        metavar="NAME",
        default=None,
        help="close training job NAME (one its program left open: it holds memory and its name)",
    )
    p.set_defaults(fn=commands["jobs"])

    p = client_cmd("status", "show workers, models and queues")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="a live view, refreshed every SECONDS (default 2) until Ctrl-C; when stdout is not "
        "a terminal, one plain-text snapshot every SECONDS",
    )
    p.add_argument(
        "--count", type=int, default=None, metavar="N", help="with --watch: stop after N snapshots"
    )
    p.set_defaults(fn=commands["status"])

    p = client_cmd("deploy", "deploy a model: a factory, or a Hugging Face directory (--hf)")
    p.add_argument("name")
    p.add_argument(
        "factory", nargs="?", default=None, help="module:callable from the broker's allow-list"
    )
    p.add_argument(
        "--hf",
        default=None,
        metavar="DIR",
        help="a local Hugging Face model directory (config.json and safetensors) under the "
        "workers' data roots, instead of a factory",
    )
    p.add_argument("--kwargs", help="factory keyword arguments as JSON")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="without --weights (or --hf), the model is initialised from this seed (default 0)",
    )
    p.add_argument("--weights", default=None, help="safetensors file the workers can read")
    p.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16")
    p.add_argument("--stages", type=int, default=None, help="pipeline stages (default: auto)")
    p.add_argument("--max-batch", type=int, default=8, help="most rows batched into a forward")
    p.add_argument("--replicas", type=int, default=None, help="copies of the pipeline")
    p.add_argument(
        "--inputs",
        default=None,
        metavar="JSON",
        help='the inputs when the model declares none: {"x": {"dtype": "float32", "shape": '
        "[-1, 784]}} (-1: a free dimension)",
    )
    p.add_argument("--slo-ms", type=float, default=None, help="latency objective, milliseconds")
    p.add_argument(
        "--max-context",
        type=int,
        default=None,
        metavar="N",
        help="language models: the longest sequence, prompt + new tokens (default: the model's "
        "own positions)",
    )
    p.add_argument(
        "--max-seqs",
        type=int,
        default=None,
        metavar="N",
        help="language models: sequences each replica runs at once (default 16)",
    )
    p.add_argument(
        "--kv-share",
        type=float,
        default=None,
        metavar="F",
        help="language models: the share (0, 1] of each worker's serving memory the KV cache of "
        "its stage may take (default 0.5)",
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a bar of the weights read so far (default: when stderr is a terminal)",
    )
    p.set_defaults(fn=commands["deploy"], timeout=600.0)

    p = client_cmd("undeploy", "remove a model")
    p.add_argument("name")
    p.add_argument(
        "--drain",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how long its running generations may take to end first (default: the broker's "
        "--undeploy-drain, 30 s; 0: at once)",
    )
    p.set_defaults(fn=commands["undeploy"])

    p = client_cmd("infer", "run one request (random inputs of the declared shape by default)")
    p.add_argument("name")
    p.add_argument("--input", help="safetensors file of named input tensors")
    p.add_argument("--batch", type=count_arg, default=1, help="rows of random inputs (1)")
    p.add_argument("--seq", type=count_arg, default=16, help="size of free dimensions (16)")
    p.add_argument("--output", help="write the outputs to this safetensors file")
    p.set_defaults(fn=commands["infer"])

    p = client_cmd("generate", "generate text with a language model, printed as it comes")
    p.add_argument("name", help="a model deployed from a Hugging Face directory")
    p.add_argument("prompt", nargs="?", default=None, help="the prompt's text (or --ids)")
    p.add_argument(
        "--ids", default=None, metavar="1,2,3", help="the prompt as token ids, instead of text"
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is one user message, written with the model's chat template",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="the most new tokens (default 16)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0: the most likely token (greedy)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: no cut)")
    p.add_argument("--top-k", type=int, default=0, help="the k most likely tokens (0: no cut)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    p.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="a stop string: the text ends before it (repeatable)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="go on past the model's end-of-sequence token"
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the result (text, ids, finish_reason, counts, timings) as JSON, once done",
    )
    p.set_defaults(fn=commands["generate"])

    # Any torch.optim optimizer by name: the worker (or partitioner) resolves it, and refuses
    # what it cannot run, saying why (flowmesh.optimizers); the CLI does not import torch.
    optimizer_help = "a torch.optim optimizer by name, any case (adam, sgd, rmsprop, nadam, ...)"
    p = client_cmd("plan", "plan pipeline stages or training chunks for a model")
    p.add_argument("factory")
    p.add_argument("--kwargs")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--stages", type=int, default=None)
    p.add_argument("--mem-cap", default=None, help="bytes per stage (default: smallest worker)")
    p.add_argument("--target", default=None, help="training chunk target bytes (chunk plan)")
    p.add_argument("--optimizer", default="adam", help=optimizer_help)
    p.add_argument(
        "--momentum", type=float, default=None, help="sgd only: plan its momentum buffer too"
    )
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--measure", action="store_true", help="time each block")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=commands["plan"], timeout=120.0)

    p = client_cmd(
        "train", "train a model (a factory, or a Hugging Face directory) for N steps"
    )
    p.add_argument(
        "factory", nargs="?", default=None,
        help="module:callable from the broker's allow-list (or --hf DIR)",
    )  # fmt: skip
    p.add_argument(
        "--hf", default=None, metavar="DIR",
        help="a Hugging Face model directory the workers can read, its weights the start "
        "(instead of a factory; --seed then seeds only the job's random stream)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--name", default=None, help="job name (default: train-<pid>)")
    p.add_argument("--kwargs", help="factory keyword arguments as JSON")
    p.add_argument("--seed", type=int, default=0, help="seeded initial weights and random stream")
    p.add_argument(
        "--weights", default=None,
        help="safetensors file the workers can read, the weights to start from (--seed then "
        "seeds only the job's random stream)",
    )  # fmt: skip
    p.add_argument("--resume", default=None, help="checkpoint directory written by --save")
    p.add_argument(
        "--dtype",
        default=None,
        help="what the forward and the loss compute in: float32 (default), or bfloat16, mixed "
        "precision (autocast; the weights, gradients and optimizer state stay float32); "
        "with --resume, the checkpoint's",
    )
    p.add_argument("--batch", type=int, default=8, help="rows per step")
    p.add_argument("--optimizer", default="adamw", help=optimizer_help)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=None)
    p.add_argument("--momentum", type=float, default=None, help="sgd only")
    p.add_argument("--loss", default="cross_entropy", help="cross_entropy | mse")
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    p.add_argument(
        "--pipeline",
        type=pipeline_arg,
        default=0,
        metavar="N|auto",
        help="the model cut into N stages on N workers, its micro-batches (--accumulate) "
        "flowing through them (default 0: one worker, by memory flow; auto: the broker's "
        "choice, stages only for a job that does not fit one worker's free training bytes)",
    )
    p.add_argument(
        "--activations",
        default=None,
        help="what each sub-model's backward does for its forward's activations: recompute, "
        "keep, selective (keep the matrix products' outputs, compute the rest again), or auto "
        "(default: whichever the worker measured cheaper)",
    )
    p.add_argument("--chunk-bytes", default=None, help="sub-model target size (e.g. 4MiB)")
    p.add_argument(
        "--data",
        default=None,
        help="a .safetensors file with 'inputs' (or 'inputs/<name>') and 'targets', or any other "
        "file as a text corpus for next-byte prediction in windows of 32 bytes (default: the "
        "built-in synthetic dataset matched to the model's declared inputs)",
    )
    p.add_argument("--samples", type=int, default=256, help="rows of the synthetic dataset")
    p.add_argument("--seq", type=int, default=16, help="free input dimensions (synthetic)")
    p.add_argument("--data-seed", type=int, default=0, help="synthetic dataset seed")
    p.add_argument("--inflight", type=int, default=2, help="steps sent ahead of their answers")
    p.add_argument("--save", default=None, help="checkpoint directory at the end (on the worker)")
    p.add_argument("--json", action="store_true", help="print the per-step losses as JSON")
    p.set_defaults(fn=commands["train"], timeout=600.0)

    p = client_cmd("sweep", "hyper-parameter sweep from a TOML file (Optuna, with pruning)")
    p.description = SWEEP_HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("config", help="the sweep's TOML file (keys: see above)")
    p.add_argument("--out", default=None, help="output directory (overrides 'out')")
    p.add_argument("--quiet", action="store_true", help="no live table, no results table")
    p.add_argument(
        "--json", action="store_true", help="print the trials as JSON on stdout (and no tables)"
    )
    p.add_argument(
        "--storage",
        default=None,
        help="Optuna storage shared by every driver of the study 'name': sqlite:///PATH, "
        "postgresql+psycopg://USER@HOST/DB or journal:PATH (default: in memory, this driver only)",
    )
    p.add_argument(
        "--heartbeat", type=int, default=5, help="seconds between a driver's heartbeats (RDB)"
    )
    p.add_argument(
        "--grace",
        type=int,
        default=None,
        help="seconds without a heartbeat before a trial is failed and retried (default 2x)",
    )
    p.set_defaults(fn=commands["sweep"], timeout=600.0)

    p = add(sub, "demo", "the main job: embedded mesh serving, generating and training")
    demo_options.add_options(p)
    p.set_defaults(fn=commands["demo"])

    p = add(sub, "gateway", "HTTP gateway: OpenAI-compatible and KServe v2 routes to the mesh")
    gateway_options(p)
    p.set_defaults(fn=commands["gateway"])
    return ap
