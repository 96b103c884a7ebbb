"""The `jmp-policy` command (also `python -m jmp_policy`).

Subcommands:
  demo    train one model under four precisions and show what happened
  doctor  report which gradients float16 / bfloat16 could not hold; with --fp8,
          which modules an FP8 recipe should leave in bf16
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import pathlib
import reprlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

PROG = "jmp-policy"
# `doctor`: float32 training steps before the gradients are measured; its PNG.
DOCTOR_STEPS = 200
DOCTOR_OUTPUT = "jmp_policy_doctor.png"
# `doctor --fp8`: the output's largest relative error against float32.
FP8_TOLERANCE = 0.03
_DEMO_EXTRA = ("sklearn", "matplotlib", "tqdm")
_FLAX_EXTRA = ("flax",)  # every command trains a Flax model


class _UsageError(Exception):
    """A bad command line: reported in one line, without a traceback."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block and exits; one line is enough and
    # `main` returns the exit code instead of raising SystemExit.
    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high), else a one-line error saying `what`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value < high:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _int_in(1, sys.maxsize, "a positive integer")
_seed = _int_in(0, 2**32, "an integer in [0, 2^32)")  # numpy's seeds


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value


def _check_writable(path: pathlib.Path, command: str) -> None:
    """Fails now, not after minutes of training, if `path` cannot be written."""
    where = f"{PROG} {command}: error: --output {str(path)!r}"
    if path.is_dir():
        raise _UsageError(f"{where} is a directory, not a file name")
    if not path.parent.is_dir():
        problem = "is not a directory" if path.parent.exists() else "does not exist"
        raise _UsageError(f"{where}: {str(path.parent)!r} {problem}")
    existed = path.exists()
    try:
        # Opening is the only test that also catches read-only file systems
        # (and root, for whom os.access always says yes).
        with open(path, "ab"):
            pass
    except OSError as e:
        raise _UsageError(f"{where} is not writable: {e.strerror or e}") from None
    if not existed:
        os.unlink(path)


def _check_installed(modules: Sequence[str], command: str, extra: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        names = {"sklearn": "scikit-learn"}
        raise _UsageError(
            f"{' '.join(filter(None, (PROG, command)))}: error: needs "
            f"{', '.join(names.get(m, m) for m in missing)}: pip install 'jmp_policy[{extra}]'"
        )


def _check_demo_extra(command: str) -> None:
    _check_installed(_DEMO_EXTRA, command, "demo")


def _build_parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        description="Mixed precision for JAX, Flax and optax: a demo and diagnostics.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{demo,doctor}")
    _add_demo(sub)
    _add_doctor(sub)
    return parser


def _add_demo(sub: Any) -> None:
    from jmp_policy.app import demo

    p = sub.add_parser(
        "demo",
        help="train a Flax MLP on 8x8 digits in float32, bfloat16 and float16 (with and "
        "without loss scaling), print a table, write a PNG",
        description="Trains a Flax MLP on scikit-learn's 8x8 digits four times: float32; "
        "mixed_bfloat16; mixed_float16 with dynamic loss scaling; mixed_float16 without. "
        "Prints a table and writes a PNG of the loss curves and the loss scale.",
    )
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help=f"training steps per run (default {demo.DEFAULT_STEPS}, --quick: {demo.QUICK_STEPS})",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help=f"examples per step (default {demo.DEFAULT_BATCH_SIZE}, "
        f"--quick: {demo.QUICK_BATCH_SIZE})",
    )
    p.add_argument(
        "--output",
        type=pathlib.Path,
        default=pathlib.Path(demo.DEFAULT_OUTPUT),
        metavar="PATH",
        help=f"where the PNG goes (default {demo.DEFAULT_OUTPUT})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a run of seconds: a smoke test, its numbers mean little",
    )
    p.add_argument(
        "--loss-multiplier",
        type=_positive_float,
        default=demo.DEFAULT_LOSS_MULTIPLIER,
        metavar="M",
        help="the loss is mean cross-entropy x M (default 2^-15 = "
        f"{demo.DEFAULT_LOSS_MULTIPLIER:g}; 1: the plain loss, whose gradients "
        "float16 holds)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="data split, initialisation, batches")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_doctor(sub: Any) -> None:
    from jmp_policy.app import demo
    from jmp_policy.app.fp8_doctor import RECIPES as FP8_RECIPES

    p = sub.add_parser(
        "doctor",
        help="which gradients of the demo model float16 / bfloat16 could not hold; a "
        "recommended policy and loss scale; a PNG histogram",
        description="Trains the demo model in float32 for a while, then reports, per weight "
        "and activation gradient, the share of values that would underflow or overflow in "
        "float16 and bfloat16, a recommended policy and loss scale, and matrix products "
        "whose sizes are not multiples of 8. For your own model use "
        "jmp_policy.diagnose(grad_fn, *args).",
    )
    # Options of the float32 doctor alone: None where not given, so that --fp8 refuses them.
    p.add_argument(
        "--steps",
        type=_positive_int,
        help=f"float32 training steps before the gradients are measured (default {DOCTOR_STEPS})",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        help=f"examples per step (default {demo.DEFAULT_BATCH_SIZE})",
    )
    p.add_argument(
        "--output",
        type=pathlib.Path,
        metavar="PATH",
        help=f"where the PNG goes (default {DOCTOR_OUTPUT})",
    )
    p.add_argument(
        "--loss-multiplier",
        type=_positive_float,
        metavar="M",
        help="as for demo (default 2^-15)",
    )
    p.add_argument("--seed", type=_seed, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--fp8",
        metavar="MODEL",
        help="instead: measure the FP8 recipes on MODEL ('transformer', the example "
        "Transformer LM, or 'package.module:function' returning (model.apply, variables, "
        "args) of a linen model) and print the rules that keep its most sensitive modules "
        "in bf16",
    )
    p.add_argument(
        "--tolerance",
        type=_positive_float,
        default=None,
        help=f"with --fp8: the output's largest relative error against float32 (default "
        f"{FP8_TOLERANCE})",
    )
    p.add_argument(
        "--recipes",
        default=None,
        help=f"with --fp8: the policies to try, comma-separated (default {','.join(FP8_RECIPES)})",
    )


def _run_demo(args: argparse.Namespace) -> int:
    from jmp_policy.app import demo

    _check_writable(args.output, "demo")
    _check_demo_extra("demo")
    steps = args.steps or (demo.QUICK_STEPS if args.quick else demo.DEFAULT_STEPS)
    batch = args.batch_size or (demo.QUICK_BATCH_SIZE if args.quick else demo.DEFAULT_BATCH_SIZE)
    demo.run_demo(
        steps=steps,
        batch_size=batch,
        output=args.output,
        loss_multiplier=args.loss_multiplier,
        seed=args.seed,
        progress=not args.no_progress,
    )
    return 0


def _run_fp8_doctor(args: argparse.Namespace) -> int:
    from jmp_policy.app import fp8_doctor

    recipes = ",".join(fp8_doctor.RECIPES) if args.recipes is None else args.recipes
    recipes = [r.strip() for r in recipes.split(",") if r.strip()]
    try:
        fp8_doctor.checked_recipes(recipes)
    except ValueError as e:  # A bad recipe: its message names it.
        raise _UsageError(f"{PROG} doctor: error: --recipes: {e}") from None
    apply, variables, model_args = _fp8_model(args.fp8, args.seed)
    tolerance = FP8_TOLERANCE if args.tolerance is None else args.tolerance
    # The model's own errors reach the user unchanged, with their traceback.
    report = fp8_doctor.recommend_fp8_rules(
        apply, variables, *model_args, tolerance=tolerance, recipes=recipes
    )
    print(f"jmp-policy doctor --fp8 {args.fp8}:")
    print(report)
    return 0


def _fp8_model(name: str, seed: int) -> tuple:
    """`(apply, variables, args)` of the model `--fp8` names."""
    if name == "transformer":
        import jax

        from jmp_policy.app import transformer_lm as lm

        batches, _, vocab = lm.make_data(1, seed=seed)
        model = lm.make_model(vocab)
        params = lm.init_params(model, "float32", seed)
        return model.apply, {"params": params}, (jax.numpy.asarray(batches[0, :, :-1]),)
    usage = (
        f"{PROG} doctor: error: --fp8 takes 'transformer' or 'package.module:function' "
        f"(a function returning (model.apply, variables, args)), got {name!r}"
    )
    module_name, sep, attr = name.partition(":")
    if not (sep and module_name and attr):
        raise _UsageError(usage)
    # As `python -m` does: a module of yours in the current directory imports.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the module named not being found: an import inside it fails as it is.
        if not (e.name == module_name or module_name.startswith(f"{e.name}.")):
            raise
        raise _UsageError(f"{PROG} doctor: error: --fp8 {name!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise _UsageError(f"{usage}: {module_name} has no function {attr!r}")
    made = factory()
    if not (
        isinstance(made, (tuple, list))
        and len(made) == 3
        and callable(made[0])
        and isinstance(made[2], (tuple, list))
    ):
        raise _UsageError(f"{usage}; it returned {type(made).__name__} {reprlib.repr(made)}")
    return tuple(made)


def _run_doctor(args: argparse.Namespace) -> int:
    from jmp_policy.app import demo, doctor
    from jmp_policy.core.diagnostics import diagnose

    float32_options = {
        "--steps": args.steps, "--batch-size": args.batch_size, "--output": args.output,
        "--loss-multiplier": args.loss_multiplier, "--no-progress": args.no_progress or None,
    }  # fmt: skip
    if args.fp8 is not None:
        for flag, value in float32_options.items():
            if value is not None:
                raise _UsageError(f"{PROG} doctor: error: {flag} is not an option of --fp8")
        return _run_fp8_doctor(args)
    for flag, value in (("--tolerance", args.tolerance), ("--recipes", args.recipes)):
        if value is not None:
            raise _UsageError(f"{PROG} doctor: error: {flag} is an option of --fp8")
    args.steps = args.steps or DOCTOR_STEPS
    args.batch_size = args.batch_size or demo.DEFAULT_BATCH_SIZE
    args.output = args.output or pathlib.Path(DOCTOR_OUTPUT)
    args.loss_multiplier = args.loss_multiplier or demo.DEFAULT_LOSS_MULTIPLIER

    _check_writable(args.output, "doctor")
    _check_demo_extra("doctor")
    data = demo.load_data(args.seed)
    model = demo.MLP()
    initial = demo.init_params(model, data, args.seed)
    f32 = demo.CONFIGS[0]
    result = demo.train(
        f32,
        data,
        initial,
        steps=args.steps,
        batch_size=args.batch_size,
        loss_multiplier=args.loss_multiplier,
        seed=args.seed,
        progress=not args.no_progress,
        model=model,
    )
    x, y = data.x_train[: args.batch_size], data.y_train[: args.batch_size]
    variables = demo.with_perturbations(model, result.params, x)
    grad_fn = demo.activation_grad_fn(model, args.loss_multiplier)
    report = diagnose(grad_fn, variables, x, y)
    print(
        f"jmp-policy doctor: the demo model after {args.steps} float32 steps, loss x "
        f"{demo.format_multiplier(args.loss_multiplier)}, one batch of {len(x)}. 'params/...' "
        "are weight gradients, 'perturbations/...' activation gradients (Flax `perturb`)."
    )
    print(doctor.report_text(report))
    doctor.plot_histogram(
        report,
        args.output,
        title="Demo model: weight and activation gradients (float32), "
        f"{100 * report.total.zero:.0f}% exact zeros not shown",
    )
    print(f"Wrote {args.output}.")
    return 0


_COMMANDS = {"demo": _run_demo, "doctor": _run_doctor}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`) and returns the exit code.

    Bad arguments give a one-line message on stderr and exit code 2.
    """
    try:
        _check_installed(_FLAX_EXTRA, "", "flax")
        parser = _build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version
            return e.code if isinstance(e.code, int) else 0
        if args.command is None:
            raise _UsageError(
                f"{PROG}: error: a command is required: demo or doctor (see '{PROG} --help')"
            )
        return _COMMANDS[args.command](args)
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
