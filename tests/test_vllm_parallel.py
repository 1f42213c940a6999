"""``--load-format phx`` with vLLM's real model code at tensor parallel 2 x
pipeline parallel 2, ranks simulated on the CPU: four processes, a gloo
process group, vLLM's own ``init_distributed_environment`` /
``initialize_model_parallel``, ``LlamaForCausalLM`` built by vLLM's loader
(its ``create_model`` and ``load_weights``, as ``load_model`` calls them;
``process_weights_after_loading`` then repacks weights for vLLM's CPU
kernels, which are not built here) from a small Llama checkpoint (2 shards
and an index; a vocabulary that is not a multiple of vLLM's padding; fewer
kv heads than q heads).

Each rank loads the model twice, with vLLM's default loader (``safetensors``)
and with ``phx``, and reports every parameter's bytes and the bytes phx read
(phx's own I/O counters, and the loader's plan).  Checked: the parameters
are equal to the default loader's on every rank; each rank reads only its
part (its pipeline stage's layers, its tensor-parallel rows or columns, its
vocabulary shard): all ranks together at most 1.1x the checkpoint; and
``get_all_weights`` (what vLLM's ``reload_weights`` feeds the model with)
gives the same parameters again, reading whole tensors and saying so.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from test_loader import rand_tensor  # noqa: E402
from test_vllm import ROOT, SITE  # noqa: E402  (skips without the private vllm)

TP, PP = 2, 2
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 4, "vocab_size": 250, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}

RANK = textwrap.dedent(r"""
    import hashlib, json, logging, os, sys
    import torch
    rank, world, tp, pp, model, port, out = sys.argv[1:]
    rank, world, tp, pp = int(rank), int(world), int(tp), int(pp)
    logs = []
    class H(logging.Handler):
        def emit(self, rec):
            logs.append(rec.getMessage())
    import phx, phx_vllm
    phx_vllm.register()
    logging.getLogger("vllm").addHandler(H())
    logging.getLogger("vllm").setLevel(logging.INFO)
    from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader import get_model_loader
    mc = ModelConfig(model=model, tokenizer=model, skip_tokenizer_init=True, dtype="bfloat16",
                     enforce_eager=True)

    def config(fmt, extra):
        return VllmConfig(model_config=mc,
                          parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                         pipeline_parallel_size=pp),
                          device_config=DeviceConfig("cpu"),
                          load_config=LoadConfig(load_format=fmt,
                                                 model_loader_extra_config=extra))

    from vllm.utils.torch_utils import set_default_torch_dtype

    def load(ld, cfg):
        # what vLLM's load_model does up to the weights (create_model, then
        # load_weights); its process_weights_after_loading repacks weights
        # for vLLM's CPU kernels (vllm._C, not built for this torch)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            m = ld.create_model(vllm_config=cfg, model_config=mc)
        ld.load_weights(m, mc)
        return m

    def digests(m):
        return {n: hashlib.blake2b(p.detach().contiguous().view(-1).view(torch.uint8).numpy()
                                   .tobytes(), digest_size=16).hexdigest()
                for n, p in m.named_parameters()}

    ref_cfg = config("safetensors", {})
    phx_cfg = config("phx", {"group_bytes": 65536})
    res = {"rank": rank}
    with set_current_vllm_config(ref_cfg):
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                                        backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp,
                                     pipeline_model_parallel_size=pp)
        ref = load(get_model_loader(ref_cfg.load_config), ref_cfg)
        res["ref"] = digests(ref)
        res["tp_rank"] = ps.get_tp_group().rank_in_group
        res["pp_rank"] = ps.get_pp_group().rank_in_group
    with set_current_vllm_config(phx_cfg):
        logs.clear()
        ld = get_model_loader(phx_cfg.load_config)
        res["cls"] = type(ld).__name__
        before = phx.stats()["bytes_read"]
        m = load(ld, phx_cfg)
        res["read"] = phx.stats()["bytes_read"] - before
        res["planned"] = sum(p.read_bytes() for p in ld.plans)
        res["partial"] = sum(len(p.partial) for p in ld.plans)
        res["phx"] = digests(m)
        res["load_logs"] = [x for x in logs if x.startswith(("phx", "Loading weights took"))]
        # vLLM's reload path (RL weight sync): reload_weights -> get_all_weights
        logs.clear()
        for p in m.parameters():
            p.data.zero_()
        # reload_weights(vllm_config, model, None, ...) asks the configured
        # loader for get_all_weights and feeds model.load_weights with it
        # (around it, its layerwise processing calls vLLM's CPU kernels: not
        # built here)
        ld2 = get_model_loader(phx_cfg.load_config)
        res["has_get_all_weights"] = hasattr(ld2, "get_all_weights")
        before = phx.stats()["bytes_read"]
        m.load_weights(ld2.get_all_weights(mc, m))
        res["reload_read"] = phx.stats()["bytes_read"] - before
        res["reloaded"] = digests(m)
        res["reload_logs"] = [x for x in logs if x.startswith("phx")]
    json.dump(res, open(out, "w"))
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_llama(d: str, rng) -> dict[str, torch.Tensor]:
    """A small Llama checkpoint in Hugging Face's names, 2 shards and an index."""
    c = CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    sd = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)})
    sd = {k: rand_tensor(rng, s, torch.bfloat16) for k, s in sd.items()}
    names = list(sd)
    wm = {}
    for s, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
        fname = f"model-{s + 1:05d}-of-00002.safetensors"
        st.save_file({k: sd[k] for k in part}, os.path.join(d, fname))
        wm.update({k: fname for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    return sd


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import numpy as np
    d = str(tmp_path_factory.mktemp("llama"))
    sd = write_llama(d, np.random.default_rng(2024))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), SITE) if p]))
    port = _free_port()
    world = TP * PP
    procs, outs = [], []
    for r in range(world):
        out = os.path.join(d, f"rank{r}.json")
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), str(world), str(TP), str(PP), d, str(port), out],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    total = sum(t.numel() * t.element_size() for t in sd.values())
    return [json.load(open(o)) for o in outs], total


def test_parameters_equal_the_default_loaders_on_every_rank(ranks):
    res, _ = ranks
    assert sorted((r["tp_rank"], r["pp_rank"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in res:
        assert r["cls"] == "PhxModelLoader"
        assert r["phx"] and sorted(r["phx"]) == sorted(r["ref"]), r["rank"]
        bad = [n for n in r["ref"] if r["phx"][n] != r["ref"][n]]
        assert not bad, (r["rank"], bad)


def test_each_rank_reads_its_part(ranks):
    """Pipeline stages read their own layers, tensor-parallel ranks their
    slices: the ranks together read the checkpoint about once (the norms,
    which every tensor-parallel rank keeps whole, twice)."""
    res, total = ranks
    print(f"checkpoint {total} bytes; per rank (tp, pp): " + ", ".join(
        f"({r['tp_rank']},{r['pp_rank']}) {r['read']}" for r in res))
    for r in res:
        assert r["read"] == r["planned"], r
        assert r["partial"] > 0, r
        assert 0.15 * total < r["read"] < 0.3 * total, (r["rank"], r["read"], total)
        assert any("this rank reads" in x for x in r["load_logs"]), r["load_logs"]
        if r["rank"] == 0:      # vLLM logs it on the (local) first rank
            assert any(x.startswith("Loading weights took") for x in r["load_logs"]), \
                r["load_logs"]
    assert sum(r["read"] for r in res) <= 1.1 * total


def test_reload_weights_through_get_all_weights(ranks):
    """vLLM's reload_weights finds get_all_weights and fills the model again
    (its parameters were zeroed) with the same bytes; a reload reads whole
    tensors (the model is in its loaded form) and logs why."""
    res, total = ranks
    for r in res:
        assert r["has_get_all_weights"]
        bad = [n for n in r["ref"] if r["reloaded"][n] != r["ref"][n]]
        assert not bad, (r["rank"], bad)
        assert any("reading whole tensors: reload_weights" in x for x in r["reload_logs"]), \
            r["reload_logs"]
        assert r["reload_read"] > r["read"]
