"""The command-line tool: plans, help, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import math

import pytest

import shardsolve
from shardsolve.cli import main
from shardsolve.errors import ShardsolveError


def _run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_command_writes_a_plan(capsys, tmp_path, models_dir):
    out = tmp_path / "plan.json"
    code, stdout, _ = _run(capsys, "plan", f"{models_dir}/mlp.py:mlp", "--mesh", "data=2,model=4", "-o", str(out))
    assert code == 0, stdout
    assert "step time" in stdout and "args" in stdout
    data = json.loads(out.read_text())
    assert data["format"] == "shardsolve-plan" and data["mesh"]["axes"][0]["name"] == "data"
    assert data["source"].startswith(f"{models_dir}/mlp.py:mlp")


def test_hbm_bandwidth_prices_compute_as_a_roofline(capsys, tmp_path, models_dir):
    """FLOPs at peak by default (the plan file says no HBM bandwidth); with ``--hbm-bandwidth`` the bytes count."""
    costs = {}
    for name, extra in (("flops", ()), ("roofline", ("--hbm-bandwidth", "8.19e11"))):
        out = tmp_path / f"{name}.json"
        code, stdout, _ = _run(capsys, "plan", f"{models_dir}/mlp.py:mlp", "--mesh", "data=2,model=4", *extra,
                               "-o", str(out))
        assert code == 0, stdout
        data = json.loads(out.read_text())
        assert data["mesh"]["hbm_bandwidth"] == (None if name == "flops" else 8.19e11)
        loaded = shardsolve.load_plan(out)
        assert loaded.mesh.hbm_bandwidth == (math.inf if name == "flops" else 8.19e11)
        costs[name] = data["cost"]["compute"]
    assert costs["roofline"] > costs["flops"] > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "nope.py", "--mesh", "data=2"], "does not exist"),
        (["plan", "{models}/mlp.py:nothing", "--mesh", "data=2,model=4"], "has no model named 'nothing'"),
        (["plan", "{models}/../experiments/programs.py:vit", "--mesh", "data=2,model=4"],
         "returned tuple, not a shardsolve.Model; return shardsolve.Model(fun=step"),
        (["plan", "{models}/mlp.py", "--mesh", "data=2,,model"], "cannot parse mesh axis"),
        (["plan", "{models}/mlp.py", "--mesh", "data=2,model=4", "--memory-limit", "1KiB"], "no plan satisfies"),
        (["plan", "{models}/mlp.py", "--mesh", "batch=8"], "unknown mesh axis 'data'"),
        (["plan", "{models}/mlp.py", "--mesh", "data=2,model=4", "--hbm-bandwidth", "0"], "--hbm-bandwidth 0.0 must"),
    ],
)
def test_bad_input_exits_2_without_traceback_or_file(capsys, tmp_path, models_dir, argv, message):
    out = tmp_path / "plan.json"
    argv = [a.replace("{models}", str(models_dir)) for a in argv] + ["-o", str(out)]
    code, stdout, stderr = _run(capsys, *argv)
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr + stdout
    assert len(stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.iterdir())


def test_help_and_no_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    assert "plan" in capsys.readouterr().out
    assert main([]) == 2


def test_model_source_is_written_and_read_one_way():
    from shardsolve.cli.common import ModelSource

    for source in (ModelSource("models/mlp.py:mlp"), ModelSource("my models/m.py:f", "large", "expert")):
        assert ModelSource.parse(str(source)) == source
    assert str(ModelSource("models/mlp.py:mlp", "small", "default")) == "models/mlp.py:mlp --size small --annotations default"
    with pytest.raises(ShardsolveError, match="names no model"):
        ModelSource.parse("")


def test_output_in_a_missing_directory_is_refused_before_planning(capsys, tmp_path, models_dir):
    out = tmp_path / "missing" / "plan.json"
    code, stdout, stderr = _run(capsys, "plan", f"{models_dir}/mlp.py", "--mesh", "data=2,model=4", "-o", str(out))
    assert code == 2 and "does not exist" in stderr and "step time" not in stdout
    assert len(stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_a_typed_key_argument_is_shown_as_the_key(capsys, tmp_path):
    """A typed PRNG key is planned on its data; the tables show it as the key it is, with a sharding of its rank."""
    model = tmp_path / "noisy.py"
    model.write_text(
        "import jax, jax.numpy as jnp\n"
        "from jax.sharding import PartitionSpec as P\n"
        "import shardsolve\n\n"
        "def noisy(size='small'):\n"
        "    def step(x, keys):\n"
        "        noise = jax.vmap(lambda k, row: jax.random.normal(k, row.shape))(keys, x)\n"
        "        return x + noise, jax.vmap(lambda k: jax.random.split(k)[0])(keys)\n"
        "    args = (jax.ShapeDtypeStruct((16, 8), jnp.float32),\n"
        "            jax.ShapeDtypeStruct((16,), jax.random.key(0).dtype))\n"
        "    return shardsolve.Model(fun=step, args=args, in_shardings=(P('data'), P('data')))\n"
    )
    out = tmp_path / "plan.json"
    code, stdout, _ = _run(capsys, "plan", f"{model}:noisy", "--mesh", "data=2,model=4", "-o", str(out))
    assert code == 0, stdout
    key_rows = [line for line in stdout.splitlines() if "args[1]" in line or "outputs[1]" in line]
    assert len(key_rows) == 2 and all("key<threefry2x32>[16]" in line for line in key_rows), key_rows
    assert "uint32" not in "".join(key_rows)
    code, stdout, _ = _run(capsys, "explain", str(out), "--show", "args[1]")
    assert code == 0, stdout
    assert "key<threefry2x32>[16]" in stdout and "uint32" not in stdout, stdout


def test_summary_line_says_what_speaks_for_the_plan():
    """A summary names the certified gap, or, where propagation's plan was kept (priced faster than the
    solver's), that no bound speaks for it rather than a 100% gap from a bound of zero."""
    from types import SimpleNamespace

    from shardsolve.cli.common import solver_status

    assert solver_status(SimpleNamespace(status="optimal", gap=0.0, stats=())) == "optimal"
    assert solver_status(SimpleNamespace(status="feasible", gap=0.125, stats=())) == "feasible, gap 12.50%"
    kept = solver_status(SimpleNamespace(status="feasible", gap=1.0, stats=(("propagation_kept", True),)))
    assert "propagation's plan" in kept and "100" not in kept
