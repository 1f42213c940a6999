"""The vLLM plugin (adapters/vllm) against the real vllm 0.33.0 package on
the CPU: the ``vllm.general_plugins`` entry point registers ``phx``
idempotently, ``--load-format phx`` parses into a LoadConfig that
``get_model_loader`` answers with our class, and ``load_weights`` feeds a
small model (through vLLM's own ``AutoWeightsLoader`` and weight loaders,
one of them a tensor-parallel narrow) with every tensor byte-exact; a
corrupt checkpoint fails the load.

vllm lives in a private folder (``make venv``: adapters/vllm/tools/
vllm-deps.sh -> .vllm-site, or ``PHX_VLLM_SITE``) because it pins another
torch; each test runs in a fresh interpreter with that folder on its path
and ``VLLM_TARGET_DEVICE=cpu`` (the wheel's CUDA build finds no GPU here).
What does not run here: vLLM serving a model on a GPU (docs/loader.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from test_loader import rand_tensor  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = os.environ.get("PHX_VLLM_SITE") or os.path.join(ROOT, ".vllm-site")
if not os.path.isdir(os.path.join(SITE, "vllm")):
    pytest.skip(f"vllm not installed in {SITE} (make venv installs it there: "
                "adapters/vllm/tools/vllm-deps.sh)", allow_module_level=True)

PRELUDE = textwrap.dedent(r"""
    import json, logging, sys
    import torch
""")


def run_vllm(code: str, *args: str, **extra_env: str) -> dict:
    """Run ``code`` with vllm importable; it prints one JSON line last."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="WARNING", **extra_env,
               PYTHONPATH=os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), SITE) if p]))
    r = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code), *args],
                       env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_entry_point_registers_phx_idempotently():
    out = run_vllm(r"""
        import importlib.metadata as md
        eps = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.name == "phx"]
        msgs = []
        class H(logging.Handler):
            def emit(self, rec):
                msgs.append(rec.getMessage())
        logging.getLogger("vllm").addHandler(H())
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor import model_loader as ml
        cls = ml._LOAD_FORMAT_TO_MODEL_LOADER.get("phx")
        import phx_vllm
        phx_vllm.register(); phx_vllm.register()
        again = ml._LOAD_FORMAT_TO_MODEL_LOADER.get("phx")
        print(json.dumps({"eps": eps, "cls": cls and f"{cls.__module__}.{cls.__name__}",
                          "same": cls is again,
                          "overwritten": [m for m in msgs if "overwritten" in m]}))
    """)
    assert out["eps"] == ["phx_vllm:register"]
    assert out["cls"] == "phx_vllm.loader.PhxModelLoader"
    assert out["same"] and not out["overwritten"], out


@pytest.mark.parametrize("setting", ["1", ""])
def test_phx_fastsafetensors_setting_switches_vllm_fastsafetensors(setting):
    """PHX_FASTSAFETENSORS=1: the plugin puts phx's copier under the names
    vLLM's --load-format fastsafetensors asks for (nogds, gds); unset: not."""
    out = run_vllm(r"""
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from fastsafetensors.copier.registry import get_copier_class
        print(json.dumps({k: get_copier_class(k).__name__ for k in ("nogds", "gds")}))
    """, PHX_FASTSAFETENSORS=setting)
    if setting:
        assert out == {"nogds": "PhxCopier", "gds": "PhxCopier"}
    else:
        assert "PhxCopier" not in out.values(), out


@pytest.mark.parametrize("setting,on", [("1", True), ("", False), ("0", False),
                                        ("false", False), ("yes", False), (" 1", False)])
def test_phx_fastsafetensors_setting_is_read_strictly(setting, on, monkeypatch, caplog):
    """Only 1 turns the copier on; an unreadable value is an error naming the
    variable (logged: a plugin never raises), not a guess."""
    import phx_vllm
    monkeypatch.setenv("PHX_FASTSAFETENSORS", setting)
    with caplog.at_level("ERROR", logger="vllm.phx_vllm"):
        assert phx_vllm.wants_fastsafetensors() is on
    bad = setting not in ("", "0", "1")
    assert ("PHX_FASTSAFETENSORS=" in caplog.text) == bad, caplog.text


def test_load_format_phx_on_the_command_line():
    out = run_vllm(r"""
        import phx_vllm
        phx_vllm.register()
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.model_executor.model_loader import get_model_loader
        def loader_for(extra):
            p = FlexibleArgumentParser()
            EngineArgs.add_cli_args(p)
            a = p.parse_args(["--model", "/nowhere", "--load-format", "phx",
                              "--model-loader-extra-config", extra])
            return get_model_loader(EngineArgs.from_cli_args(a).create_load_config())
        ld = loader_for('{"group_bytes": 65536, "progress": false}')
        try:
            loader_for('{"bogus": 1}')
            err = None
        except ValueError as e:
            err = str(e)
        print(json.dumps({"cls": type(ld).__name__, "fmt": ld.load_config.load_format,
                          "extra": ld.extra, "err": err}))
    """)
    assert out["cls"] == "PhxModelLoader" and out["fmt"] == "phx"
    assert out["extra"] == {"group_bytes": 65536, "progress": False}
    assert out["err"] and "bogus" in out["err"]


MODEL = r"""
    import phx_vllm
    phx_vllm.register()
    from types import SimpleNamespace
    from torch import nn
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.utils import AutoWeightsLoader

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(48, 40, bias=True, dtype=torch.bfloat16)
            # a column-parallel weight as vLLM keeps it: rank 1 of 2 of the rows
            self.up = nn.Parameter(torch.empty(32, 48, dtype=torch.bfloat16), requires_grad=False)
            def narrow(param, loaded):
                param.data.copy_(loaded.narrow(0, 32, 32))
            self.up.weight_loader = narrow

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(100, 48, dtype=torch.bfloat16)
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.Parameter(torch.empty(48, dtype=torch.float32), requires_grad=False)
        def load_weights(self, weights):
            return AutoWeightsLoader(self).load_weights(weights)

    path = sys.argv[1]
    model = Tiny()
    ld = get_model_loader(LoadConfig(load_format="phx",
                                     model_loader_extra_config={"group_bytes": 4096}))
    # a ModelConfig stand-in for this non-vLLM model (a real one needs a
    # Hugging Face config: tests/test_vllm_parallel.py builds Llama with it)
    cfg = SimpleNamespace(model=path, revision=None, quantization=None, is_moe=False,
                          multimodal_config=None)
    from vllm.config import VllmConfig, set_current_vllm_config
    res = {}
    # create_model: vLLM's construction (stubbed: it needs a whole VllmConfig),
    # and phx's staging prepared meanwhile only for a CUDA device (none here:
    # "cuda" on this CPU-only box must not fail the construction)
    from vllm.model_executor.model_loader import base_loader
    base_loader.BaseModelLoader.create_model = lambda self, vc, mc, prefix="": model
    for dev in ("cpu", "cuda"):
        vc = SimpleNamespace(device_config=SimpleNamespace(device=torch.device(dev)))
        assert ld.create_model(vc, cfg) is model
        res["prepared_" + dev] = ld._prepared is not None
    try:
        ld.download_model(cfg)
        with set_current_vllm_config(VllmConfig()):
            ld.load_weights(model, cfg)
        out = {n: p.detach().contiguous().view(-1).view(torch.uint8).tolist()
               for n, p in model.named_parameters()}
        res.update(params=out, partial=sorted(n for p in ld.plans for n in p.partial),
                   read=sum(p.read_bytes() for p in ld.plans))
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(res))
"""


def _checkpoint(d, rng, drop=None):
    sd = {"embed.weight": rand_tensor(rng, (100, 48), torch.bfloat16),
          "norm": rand_tensor(rng, (48,), torch.float32)}
    for i in range(2):
        sd[f"layers.{i}.proj.weight"] = rand_tensor(rng, (40, 48), torch.bfloat16)
        sd[f"layers.{i}.proj.bias"] = rand_tensor(rng, (40,), torch.bfloat16)
        sd[f"layers.{i}.up"] = rand_tensor(rng, (64, 48), torch.bfloat16)
    if drop:
        sd.pop(drop)
    names = sorted(sd)
    wm = {}
    for s, part in enumerate((names[0::2], names[1::2])):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        st.save_file({k: sd[k] for k in part}, os.path.join(d, fname))
        wm.update({k: fname for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return sd


def _bytes(t) -> list[int]:
    return t.contiguous().view(-1).view(torch.uint8).tolist()


def test_load_weights_feeds_a_small_model(data_dir, rng):
    sd = _checkpoint(data_dir, rng)
    out = run_vllm(MODEL, data_dir)
    assert "params" in out, out
    assert out["prepared_cpu"] is False
    assert out["prepared_cuda"] is torch.cuda.is_available()
    got = out["params"]
    assert sorted(got) == sorted(sd)
    for name, t in sd.items():
        want = t.narrow(0, 32, 32) if name.endswith(".up") else t
        assert got[name] == _bytes(want), name
    # the model's own narrowing weight_loader was followed: only its rows of
    # the "up" tensors were read
    assert out["partial"] == ["layers.0.up", "layers.1.up"]
    full = sum(t.numel() * t.element_size() for t in sd.values())
    assert out["read"] == full - 2 * 32 * 48 * 2


def test_load_weights_missing_or_corrupt(data_dir, rng):
    _checkpoint(data_dir, rng, drop="norm")
    out = run_vllm(MODEL, data_dir)
    assert "error" in out and "norm" in out["error"], out
    bad = os.path.join(data_dir, "model-00002-of-00002.safetensors")
    os.truncate(bad, os.path.getsize(bad) - 10)
    out = run_vllm(MODEL, data_dir)
    assert out.get("error", "").startswith("CheckpointError") and bad in out["error"], out
    os.unlink(bad)
    for f in os.listdir(data_dir):
        os.unlink(os.path.join(data_dir, f))
    out = run_vllm(MODEL, data_dir)
    assert "Cannot find any model weights" in out.get("error", ""), out


def test_register_never_raises_and_the_failure_is_said_at_use():
    """vLLM loads the plugin in every process whatever the load format: a
    loader that cannot be imported (phx.loader hidden here) is logged, other
    load formats are untouched, and --load-format phx says why."""
    out = run_vllm(r"""
        msgs = []
        class H(logging.Handler):
            def emit(self, rec):
                msgs.append(rec.getMessage())
        logging.getLogger("vllm").addHandler(H())
        sys.modules["phx.loader"] = None            # as if it could not be imported
        from vllm.plugins import load_general_plugins
        load_general_plugins()                       # the entry point: must not raise
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader
        other = type(get_model_loader(LoadConfig(load_format="safetensors"))).__name__
        try:
            get_model_loader(LoadConfig(load_format="phx"))
            err = None
        except RuntimeError as e:
            err = str(e)
        print(json.dumps({"other": other, "err": err,
                          "logged": [m for m in msgs if m.startswith("phx:")]}))
    """)
    assert out["other"] == "DefaultModelLoader"
    assert out["err"] and "load format phx is not available" in out["err"], out
    assert "phx.loader" in out["err"]
    assert any("could not be imported" in m for m in out["logged"]), out


def test_phx_fastsafetensors_without_fastsafetensors_is_logged_not_raised():
    out = run_vllm(r"""
        msgs = []
        class H(logging.Handler):
            def emit(self, rec):
                msgs.append(rec.getMessage())
        logging.getLogger("vllm").addHandler(H())
        sys.modules["fastsafetensors"] = None        # as if not installed
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.model_executor import model_loader as ml
        cls = ml._LOAD_FORMAT_TO_MODEL_LOADER.get("phx")
        print(json.dumps({"cls": cls.__name__, "logged": [m for m in msgs if m.startswith("phx:")]}))
    """, PHX_FASTSAFETENSORS="1")
    assert out["cls"] == "PhxModelLoader"            # the phx format is there all the same
    assert any("PHX_FASTSAFETENSORS=1 is not in effect" in m and "fastsafetensors is not installed"
               in m for m in out["logged"]), out


def test_expert_parallel_rank_reads_only_its_experts(data_dir, rng):
    """With vLLM's expert-parallel filter set (local experts 0 and 1 of 4),
    the other experts' weights are neither dry-run nor read; dense weights
    and expert scales (which vLLM never filters) are.  A tensor the loading
    code uses through an operation the dry run does not follow (the gate,
    reshaped) is read whole, and the log says so."""
    sd = {f"layers.0.experts.{e}.w1.weight": rand_tensor(rng, (16, 8), torch.bfloat16)
          for e in range(4)}
    sd["layers.0.experts.3.w1.weight_scale"] = rand_tensor(rng, (1,), torch.float32)
    sd["layers.0.gate.weight"] = rand_tensor(rng, (4, 8), torch.bfloat16)
    st.save_file(sd, os.path.join(data_dir, "model.safetensors"))
    out = run_vllm(r"""
        import phx_vllm
        phx_vllm.register()
        msgs = []
        class H(logging.Handler):
            def emit(self, rec):
                msgs.append(rec.getMessage())
        logging.getLogger("vllm").addHandler(H())
        logging.getLogger("vllm").setLevel(logging.INFO)
        from types import SimpleNamespace
        from torch import nn
        from vllm.config.load import LoadConfig
        from vllm.model_executor.model_loader import get_model_loader

        class Model(nn.Module):
            def load_weights(self, weights):
                seen = []
                for name, t in weights:
                    seen.append(name)
                    if name.endswith("gate.weight"):
                        t = t.reshape(-1)
                    torch.empty(t.shape, dtype=t.dtype).copy_(t)
                return set(seen)

        ld = get_model_loader(LoadConfig(load_format="phx"))
        ld.local_expert_ids = {0, 1}
        ld._slicing = True
        cfg = SimpleNamespace(model=sys.argv[1], revision=None, quantization=None)
        model = Model()
        names = sorted(n for n, _ in ld.get_all_weights(cfg, model))
        print(json.dumps({"names": names, "skipped": ld.plans[0].skipped,
                          "whole": ld.plans[0].whole,
                          "logged": [m for m in msgs if "read whole" in m]}))
    """, data_dir)
    assert out["names"] == ["layers.0.experts.0.w1.weight", "layers.0.experts.1.w1.weight",
                            "layers.0.experts.3.w1.weight_scale", "layers.0.gate.weight"], out
    assert out["skipped"] == 2
    assert out["whole"] == {"layers.0.gate.weight": "reshape"}
    assert any("1 tensors read whole" in m and "reshape" in m and "layers.0.gate.weight" in m
               for m in out["logged"]), out
