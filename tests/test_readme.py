"""The README's Python examples run, in order, in one namespace."""

import jax

from helpers import ROOT, run_python_blocks


def test_readme_examples_run(capsys):
    namespace = run_python_blocks(ROOT / "README.md")
    out = capsys.readouterr().out
    assert "skipped steps 0" in out
    loss = float(out.split("loss ", 1)[1].split(",", 1)[0])
    assert loss < 2.0, out  # 100 steps on 32 examples: well below ln(10)
    params = namespace["params"]
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jax.numpy.dtype("float32")}
