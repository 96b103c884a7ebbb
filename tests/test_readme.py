"""The README's Python examples run, in order, in one namespace."""

import pathlib
import re

import jax

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_examples_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    namespace: dict = {}
    # Users run the README under JAX's default (standard) promotion.
    with jax.numpy_dtype_promotion("standard"):
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "skipped steps 0" in out
    assert "applied 2, skipped 1, adam count 2" in out  # the counters section
    loss = float(re.search(r"loss (\S+),", out).group(1))
    assert loss < 2.0, out  # 100 steps on 32 examples: well below ln(10)
    params = namespace["params"]
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jax.numpy.dtype("float32")}
