"""jmp_policy as a package others depend on.

* The core imports with jax, numpy and optax alone: a fresh interpreter that
  imports `jmp_policy` and runs a jitted mixed precision step has not loaded
  Flax, matplotlib, scikit-learn or tqdm.
* The wheel holds the library and its command, not the repository's
  benchmarks (`benchmarks/`) or the test suite's JAX probes.
* The wheel, installed into a fresh virtual environment (no editable install,
  working directory outside the checkout), runs `jmp-policy demo --quick`,
  `jmp-policy doctor --fp8 transformer` and `import jmp_policy`.
* Every public function and class is fully annotated.
* A DeprecationWarning raised by jmp_policy's own code fails the tests (the
  `filterwarnings` setting of pyproject.toml); other packages' are shown.
"""

import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import warnings
import zipfile

import pytest

import jmp_policy
import jmp_policy.nnx

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPTIONAL = ("flax", "matplotlib", "sklearn", "tqdm", "equinox", "jaxtyping")


def _env() -> dict[str, str]:
    # Nothing of the caller's Python set-up leaks into the child.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_test_files_are_by_concern_and_short():
    # Each test file holds one concern: none over 800 lines.
    tests = pathlib.Path(__file__).resolve().parent
    long = {
        p.name: n for p in tests.glob("test_*.py") if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long


def test_core_step_imports_no_optional_package():
    code = textwrap.dedent(
        f"""
        import json, sys
        import jax, jax.numpy as jnp, numpy as np, optax
        import jmp_policy

        policy = jmp_policy.get_policy("mixed_float16")
        tx = jmp_policy.loss_scaled(optax.sgd(0.1), jmp_policy.DynamicLossScale(2.0**10))
        params = {{"w": jnp.full((4, 2), 0.5)}}
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, x):
            loss_scale = jmp_policy.get_loss_scale(opt_state)

            def loss_fn(p):
                p, x16 = policy.cast_to_compute((p, x))
                y = jmp_policy.half_dot_general(x16, p["w"], (((1,), (0,)), ((), ())))
                loss = policy.cast_to_output(jnp.mean(y**2))
                return loss_scale.scale(loss)

            grads = jmp_policy.autocast(jax.grad(loss_fn), policy)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        new_params, opt_state = step(params, opt_state, jnp.ones((3, 4)))
        loaded = sorted(
            m for m in sys.modules if m.split(".")[0] in {OPTIONAL!r}
        )
        print(json.dumps({{
            "file": jmp_policy.__file__,
            "loaded": loaded,
            "dtype": str(new_params["w"].dtype),
            "changed": bool((new_params["w"] != params["w"]).all()),
            "skipped": int(opt_state.total_notfinite),
        }}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert pathlib.Path(result["file"]).resolve().is_relative_to(ROOT / "jmp_policy")
    assert result["loaded"] == []
    # The step did run: float32 parameters, updated, nothing skipped.
    assert result["dtype"] == "float32" and result["changed"] and result["skipped"] == 0


def _copy_source(dest: pathlib.Path) -> pathlib.Path:
    """The files a clean checkout builds the wheel from (no build/ or caches)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "jmp_policy", dest / "jmp_policy", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    """The wheel, built offline (no build isolation: setuptools of this environment)."""
    src = _copy_source(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "-w",
            str(out),
            str(src),
        ],
        cwd=out,
        env=_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("jmp_policy-*.whl")
    return path


def test_wheel_contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = z.read(metadata).decode()
    # The installation guide's install command names this very file.
    assert f"dist/{wheel.name}[" in (ROOT / "docs" / "guides" / "getting_started.md").read_text()
    assert "jmp_policy/py.typed" in names
    assert "jmp_policy/app/transformer_lm.py" in names  # `doctor --fp8 transformer`'s model
    assert [n for n in names if "benchmark" in n or "jax_probes" in n] == []
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "examples/", "benchmarks/")) for n in names)
    assert "License-Expression: Apache-2.0" in meta
    assert "Requires-Python: >=3.11" in meta
    # The core's dependencies only; Flax and the demo's in extras.
    required = sorted(
        line.split(":", 1)[1].split(";")[0].strip()
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    )
    assert [r.split("<")[0].split(">")[0] for r in required] == ["jax", "jaxlib", "numpy", "optax"]


def test_installing_the_wheel_keeps_the_installed_jax(wheel):
    # pip resolves the wheel's requirements against this environment's JAX
    # (the newest under ./run test, the oldest under ./run test-oldest): with
    # no index to download from, a JAX it wanted to change would fail here.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--quiet",
         "--report", "-", str(wheel)],
        env=_env(), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installs = [i["metadata"]["name"] for i in json.loads(proc.stdout)["install"]]
    assert installs == ["jmp_policy"], installs


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh virtual environment with the wheel installed (not editable).

    The third-party packages come from this environment's site-packages,
    added as a plain path (a `.pth` line): the `.pth` files there, among them
    the editable jmp_policy's finder, are not run, so the only jmp_policy is
    the wheel's.
    """
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, env=_env())
    python = root / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        env=_env(),
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    pathlib.Path(site, "_third_party.pth").write_text("\n".join(sorted(ours)) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet", str(wheel)],
        check=True,
        env=_env(),
        cwd=root,
    )
    return root


def _run_in(venv: pathlib.Path, args: list[str], cwd: pathlib.Path, timeout: float = 600):
    env = _env()
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_installed_wheel_imports_from_the_venv(venv, tmp_path):
    code = (
        "import json, sys, jmp_policy; "
        "print(json.dumps([jmp_policy.__file__, [type(f).__name__ for f in sys.meta_path]]))"
    )
    proc = _run_in(venv, ["python", "-c", code], tmp_path)
    assert proc.returncode == 0, proc.stderr
    file, finders = json.loads(proc.stdout)
    assert pathlib.Path(file).resolve().is_relative_to(venv.resolve()), file
    assert not any("editable" in f.lower() for f in finders), finders


@pytest.mark.slow
def test_installed_wheel_runs_demo_quick(venv, tmp_path):
    proc = _run_in(
        venv, ["jmp-policy", "demo", "--quick", "--no-progress", "--output", "demo.png"], tmp_path
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "demo.png").stat().st_size > 1000
    assert "mixed_float16 + scaling" in proc.stdout


@pytest.mark.slow
def test_installed_wheel_runs_doctor_fp8_on_its_transformer(venv, tmp_path):
    args = ["jmp-policy", "doctor", "--fp8", "transformer", "--recipes", "mixed_float8"]
    proc = _run_in(venv, args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with_policy(apply, 'mixed_float8', rules=" in proc.stdout


# --------------------------------------------------------------------------
# Annotations.


def _unannotated(fn, where: str) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # A builtin without a signature.
        return []
    missing = [
        f"{where}: parameter {name!r}"
        for name, p in sig.parameters.items()
        if name not in ("self", "cls") and p.annotation is inspect.Parameter.empty
    ]
    if sig.return_annotation is inspect.Signature.empty:
        missing.append(f"{where}: return")
    return missing


def test_every_public_function_and_method_is_fully_annotated():
    missing, checked = [], 0
    for module in (jmp_policy, jmp_policy.nnx):
        for name in module.__all__:
            obj, where = getattr(module, name), f"{module.__name__}.{name}"
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr.startswith("_") and attr not in ("__init__", "__call__"):
                        continue
                    if isinstance(member, property):
                        member = member.fget
                    elif isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if inspect.isfunction(member):
                        checked += 1
                        missing += _unannotated(member, f"{where}.{attr}")
            elif inspect.isfunction(obj):
                checked += 1
                missing += _unannotated(obj, where)
    assert checked > 40  # The walk did find the API.
    assert missing == []


def test_the_public_namespace_is_all_and_the_subpackages():
    # A subprocess: a fresh import, as a user's `dir(jmp_policy)` sees it.
    code = (
        "import pkgutil, jmp_policy, jmp_policy.nnx\n"
        "subpackages = {m.name for m in pkgutil.iter_modules(jmp_policy.__path__)}\n"
        "for module in (jmp_policy, jmp_policy.nnx):\n"
        "    public = {n for n in dir(module) if not n.startswith('_')}\n"
        "    print(sorted(public - set(module.__all__) - subpackages))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["[]", "[]"], done.stdout


# --------------------------------------------------------------------------
# The DeprecationWarning filter of pyproject.toml.


def test_a_deprecation_warning_from_jmp_policy_code_is_an_error():
    for module in ("jmp_policy", "jmp_policy.integrations.autocast"):
        with pytest.raises(DeprecationWarning, match="going away"):
            warnings.warn_explicit("going away", DeprecationWarning, "x.py", 1, module=module)


def test_other_packages_deprecation_warnings_are_shown_not_raised():
    # catch_warnings keeps the test's filters (pytest.warns would reset them).
    with warnings.catch_warnings(record=True) as shown:
        for module in ("flax.nnx.statelib", "jmp_policy_other", "tests.test_x"):
            warnings.warn_explicit(f"{module} going away", DeprecationWarning, "x.py", 1, module)
    assert len(shown) == 3


def test_no_private_jax_import_and_no_reference_to_documents_outside_the_repository():
    banned = ("jax." + "_src", "design" + ".md", "../" + "shared")
    found = [
        f"{path.relative_to(ROOT)}: {word}"
        for folder in ("jmp_policy", "tests", "benchmarks", "examples", "docs")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".py", ".md", ".toml", ".txt") and "__pycache__" not in path.parts
        for word in banned
        if word in path.read_text()
    ]
    assert found == []


def _imports(path: pathlib.Path) -> set[str]:
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_each_layer_imports_only_the_layers_below_it():
    # core (jax, numpy, optax) < engine (where every dtype is decided) <
    # integrations (the front ends, the only place Flax is imported) < app.
    below = {
        "core": ("jmp_policy.core",),
        "engine": ("jmp_policy.core", "jmp_policy.engine"),
        "integrations": ("jmp_policy.core", "jmp_policy.engine", "jmp_policy.integrations"),
    }
    package = ROOT / "jmp_policy"
    for layer, allowed in below.items():
        for path in sorted((package / layer).rglob("*.py")):
            imported = _imports(path)
            own = {m for m in imported if m == "jmp_policy" or m.startswith("jmp_policy.")}
            assert all(m.startswith(allowed) for m in own), (path, sorted(own))
            if layer != "integrations":
                assert not any(m.split(".")[0] in ("flax", "equinox") for m in imported), path
