"""``--load-format phx`` with vLLM's real model code at tensor parallel 2 x
pipeline parallel 2 (Llama), and at tensor parallel 2 with expert parallel
(Mixtral), ranks simulated on the CPU: a process per rank, a gloo
process group, vLLM's own ``init_distributed_environment`` /
``initialize_model_parallel``, ``LlamaForCausalLM`` / ``MixtralForCausalLM``
built by vLLM's loader
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
vocabulary shard, its experts): all ranks together at most 1.1x the
checkpoint; and
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

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
         "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 4, "vocab_size": 250, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
MIXTRAL = dict(LLAMA, architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
#: name -> (config, tensor parallel, pipeline parallel, expert parallel)
SETUPS = {"llama-tp2-pp2": (LLAMA, 2, 2, False), "mixtral-tp2-ep": (MIXTRAL, 2, 1, True)}

RANK = textwrap.dedent(r"""
    import hashlib, json, logging, os, sys
    import torch
    rank, world, tp, pp, ep, model, port, out = sys.argv[1:]
    rank, world, tp, pp, ep = int(rank), int(world), int(tp), int(pp), ep == "1"
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
                                                         pipeline_parallel_size=pp,
                                                         enable_expert_parallel=ep),
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
        res["experts"] = sorted(n for n in res["ref"] if "experts" in n)
    with set_current_vllm_config(phx_cfg):
        logs.clear()
        ld = get_model_loader(phx_cfg.load_config)
        res["cls"] = type(ld).__name__
        before = phx.stats()["bytes_read"]
        m = load(ld, phx_cfg)
        res["read"] = phx.stats()["bytes_read"] - before
        res["planned"] = sum(p.read_bytes() for p in ld.plans)
        res["partial"] = sum(len(p.partial) for p in ld.plans)
        res["local_experts"] = sorted(ld.local_expert_ids or [])
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
    # rank 0 hosts the TCP store through which every rank makes its process
    # groups, and vLLM makes its singleton ones (dp here) with no barrier: a
    # rank 0 that exits before a slow rank has made them breaks that rank
    # ("DistNetworkError: Broken pipe"); so no rank leaves before all are done
    torch.distributed.barrier()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(d: str, c: dict, rng) -> dict[str, torch.Tensor]:
    """A small Llama (or, with experts, Mixtral) checkpoint in Hugging
    Face's names, 2 shards and an index."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    sd = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)})
        if "num_local_experts" in c:
            e = p + "block_sparse_moe."
            sd[e + "gate.weight"] = (c["num_local_experts"], h)
            for x in range(c["num_local_experts"]):
                sd.update({f"{e}experts.{x}.w1.weight": (i, h), f"{e}experts.{x}.w3.weight": (i, h),
                           f"{e}experts.{x}.w2.weight": (h, i)})
        else:
            sd.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
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


def _launch_ranks(env, d, world, tp, pp, ep, outs):
    """One process per rank on a fresh port; their return codes and logs."""
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-c", RANK, str(r), str(world), str(tp), str(pp), "1" if ep else "0",
         d, str(port), outs[r]],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, logs


@pytest.fixture(scope="module", params=sorted(SETUPS))
def ranks(request, tmp_path_factory):
    import numpy as np
    config, tp, pp, ep = SETUPS[request.param]
    d = str(tmp_path_factory.mktemp(request.param))
    sd = write_checkpoint(d, config, np.random.default_rng(2024))
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join([p for p in (os.environ.get("PYTHONPATH"), SITE) if p]))
    world = tp * pp
    outs = [os.path.join(d, f"rank{r}.json") for r in range(world)]
    procs, logs = _launch_ranks(env, d, world, tp, pp, ep, outs)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    total = sum(t.numel() * t.element_size() for t in sd.values())
    return request.param, [json.load(open(o)) for o in outs], total


def test_parameters_equal_the_default_loaders_on_every_rank(ranks):
    setup, res, _ = ranks
    _, tp, pp, ep = SETUPS[setup]
    assert sorted((r["tp_rank"], r["pp_rank"]) for r in res) == sorted(
        (t, p) for t in range(tp) for p in range(pp))
    if ep:
        # vLLM's name filter (enable_ep_weight_filter) is off by default: what
        # keeps a rank from reading the other experts is the dry run, which
        # sees FusedMoE's weight loader copy only the local ones
        assert all(r["local_experts"] == [] and r["experts"] for r in res)
    for r in res:
        assert r["cls"] == "PhxModelLoader"
        assert r["phx"] and sorted(r["phx"]) == sorted(r["ref"]), r["rank"]
        bad = [n for n in r["ref"] if r["phx"][n] != r["ref"][n]]
        assert not bad, (r["rank"], bad)


def test_each_rank_reads_its_part(ranks):
    """Pipeline stages read their own layers, tensor-parallel ranks their
    slices, expert-parallel ranks their experts: the ranks together read the
    checkpoint about once (what every rank keeps whole - the norms, the
    router - more than once)."""
    setup, res, total = ranks
    print(f"{setup}: checkpoint {total} bytes; per rank (tp, pp): " + ", ".join(
        f"({r['tp_rank']},{r['pp_rank']}) {r['read']}" for r in res))
    share = 1 / len(res)
    for r in res:
        assert r["read"] == r["planned"], r
        assert r["partial"] > 0, r
        assert 0.6 * share * total < r["read"] < 1.2 * share * total, (r["rank"], r["read"], total)
        assert any("this rank reads" in x for x in r["load_logs"]), r["load_logs"]
        if r["rank"] == 0:      # vLLM logs it on the (local) first rank
            assert any(x.startswith("Loading weights took") for x in r["load_logs"]), \
                r["load_logs"]
    assert sum(r["read"] for r in res) <= 1.1 * total


def test_reload_weights_through_get_all_weights(ranks):
    """vLLM's reload_weights finds get_all_weights and fills the model again
    (its parameters were zeroed) with the same bytes; a reload reads whole
    tensors (the model is in its loaded form) and logs why."""
    _, res, total = ranks
    for r in res:
        assert r["has_get_all_weights"]
        bad = [n for n in r["ref"] if r["reloaded"][n] != r["ref"][n]]
        assert not bad, (r["rank"], bad)
        assert any("reading whole tensors: reload_weights" in x for x in r["reload_logs"]), \
            r["reload_logs"]
        assert r["reload_read"] > r["read"]
