"""The memory estimator: parameter counts, sharding, the refusal of layouts that do not fit."""

import re

import pytest
import torch

from deadpool.launch.job import validate
from deadpool.launch.memory import GiB, check_fits, estimate, model_params, saved_activations
from deadpool.launch.memory_tables import A100_GB, MODELS, _load, measured_table, table
from deadpool.model import GPT, model_config, stage_params
from deadpool.parallel.stage import build_stage
from tests.conftest import compose_train
from tests.deadpool.helpers import run_threads

# published sizes: LLaMA (Touvron et al. 2023a, Table 2: 6.7B, 13.0B, 32.5B, 65.2B), Llama 2
# 70B (Touvron et al. 2023b: "70B"), Llama 3 8B (Meta's model card: "8B")
SIZES = {"llama_7b": 6.7e9, "llama_13b": 13.0e9, "llama_30b": 32.5e9, "llama_65b": 65.2e9,
         "llama2_70b": 70e9, "llama3_8b": 8e9, "llama3_70b": 70.6e9}


def layout_cfg(model, layout, tmp_path, gpu_gb=None, **over):
    """A resolved job config of ``model`` on ``layout``, micro-batches of one full sequence."""
    cfg = compose_train([f"model={model}", f"parallel={layout}"], tmp_path)
    pp = cfg["parallel"]["pp"]
    cfg.update({"seq_len": 2048, "batch_size": 2 * pp if pp > 1 else 1, **over})
    if gpu_gb is not None:
        cfg["memory"] = {"gpu_gb": gpu_gb}
    return cfg


@pytest.mark.parametrize("model,published", SIZES.items())
def test_parameter_count_matches_the_published_size(model, published):
    """Within 2 % of the published figure (70B rounds Llama 2's 69.0B up), and the estimator's
    count is exactly that of the module built from the config (on the meta device)."""
    m = _load("model", model)
    assert model_params(m) == pytest.approx(published, rel=0.02)
    with torch.device("meta"):
        built = sum(p.numel() for p in GPT(model_config(m)).parameters())
    assert model_params(m) == built


def test_the_grouped_query_configs_have_the_published_shapes():
    """Llama 2 70B and Llama 3 8B as released: 8 KV heads, their FFN widths and rotary bases."""
    for name, (d, layers, heads, ffn, vocab, theta) in {
            "llama2_70b": (8192, 80, 64, 28672, 32000, 10000.0),
            "llama3_8b": (4096, 32, 32, 14336, 128256, 500000.0)}.items():
        m = model_config(_load("model", name))
        assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size,
                m.rope_theta) == (d, layers, heads, 8, ffn, vocab, theta), name


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (2, 3), (4, 2)])
def test_per_rank_parameters_equal_the_built_stage(tp, pp):
    from deadpool.parallel.stage import build_stage

    m = dict(vocab_size=512, d_model=128, n_layers=3, n_heads=8, n_kv_heads=4, ffn_mult=4,
             max_seq_len=256)
    for s in range(pp):
        built = build_stage(m, 1, pp_rank=s, pp=pp, tp_rank=0, tp=tp)
        assert sum(p.numel() for p in built.parameters()) == stage_params(m, tp, pp, s)


def test_sharding_over_dp_divides_optimizer_memory_by_dp():
    m = _load("model", "llama_7b")
    kw = dict(batch_size=1, seq_len=2048, microbatches=1)
    for dp in (2, 8, 16):
        p = dict(dp=dp, tp=4, pp=1, ranks_per_node=4)
        full = estimate(m, dict(p, zero=False), **kw)["gpu"]["optimizer"]
        sharded = estimate(m, dict(p, zero=True), **kw)["gpu"]["optimizer"]
        assert full / sharded == pytest.approx(dp, rel=1e-6)
        assert estimate(m, dict(p, zero=True), **kw)["gpu"]["params"] * 2 == pytest.approx(full, rel=1e-6)


@pytest.mark.parametrize("precision,reduce,inbox_bytes", [("fp32", "fp32", 4), ("bf16", "fp32", 4),
                                                         ("bf16", "bf16", 2)])
def test_gloo_counts_the_gradient_inboxes(precision, reduce, inbox_bytes):
    """On gloo a sharded optimizer's buckets reach their owner by all-to-all into inboxes worth
    one more reduction buffer (parallel/data/zero.py: one per owned bucket, dp x the bucket); none at dp=1 or
    unsharded. ``test_zero.py`` checks the built optimizer's inboxes hold that many elements."""
    m = _load("model", "tiny")
    kw = dict(batch_size=8, seq_len=64, microbatches=1, precision=precision,
              grad_reduce_dtype=reduce)
    n = stage_params(m, 1, 1, 0)
    for dp, zero, counted in ((4, True, True), (1, True, False), (4, False, False)):
        p = dict(dp=dp, tp=1, pp=1, zero=zero)
        extra = (estimate(m, p, grad_inbox=True, **kw)["gpu"]["grads"]
                 - estimate(m, p, **kw)["gpu"]["grads"])
        assert extra == (-(-n // dp) * dp * inbox_bytes if counted else 0)


def test_what_is_replicated_and_kept_on_the_host():
    m = _load("model", "llama_13b")
    kw = dict(batch_size=4, seq_len=2048, microbatches=4, num_local_slots=3, replica_buffers=3)
    p = dict(dp=16, tp=4, pp=2, ranks_per_node=4, zero=True)
    e = estimate(m, p, **kw)
    g, h = e["gpu"], e["host_per_rank"]
    assert e["replicated_per_step"] == g["optimizer"]            # unique: the optimizer shard
    state = g["params"] + g["optimizer"]
    assert h == {"local_ring": 3 * state, "replicas": 3 * g["optimizer"], "persist": state,
                 "total": 4 * state + 3 * g["optimizer"]}
    assert e["host_per_node"] == 4 * h["total"]
    assert estimate(m, p, replicate="full", **kw)["replicated_per_step"] == state
    assert estimate(m, dict(p, dp=1), **kw)["replicated_per_step"] == (
        estimate(m, dict(p, dp=1), **kw)["gpu"]["params"] + estimate(m, dict(p, dp=1), **kw)["gpu"]["optimizer"])
    assert estimate(m, dict(p, zero=False), **kw)["replicated_per_step"] == 0  # peers hold it all
    # ft.replicas=2: sent to two buddies, and two wards' replicas held (3 buffers each here)
    e2 = estimate(m, p, replicas=2, **kw)
    assert e2["replicated_per_step"] == 2 * g["optimizer"]
    assert e2["host_per_rank"]["replicas"] == 2 * 3 * g["optimizer"]
    assert e2["host_per_rank"]["local_ring"] == h["local_ring"] and e2["gpu"] == g


def test_the_job_check_counts_no_snapshot_memory_without_snapshots():
    from deadpool.launch.memory import check_fits
    from tests.conftest import compose_train

    big = ["model=llama_7b", "parallel=dp4", "memory.host_gb_per_node=0.001"]
    with pytest.raises(ValueError, match="local ring") as on:
        check_fits(compose_train(big, "unused"))
    check_fits(compose_train(big + ["ft=none"], "unused"))  # no snapshots, no checkpoints
    with pytest.raises(ValueError, match="local ring") as off:  # its checkpoint copy only
        check_fits(compose_train(big + ["ft=checkpoint_restart"], "unused"))
    ring = lambda msg: float(msg.split("local ring ")[1].split()[0])  # noqa: E731
    replicas = lambda msg: float(msg.split("+ replicas ")[1].split()[0])  # noqa: E731
    persist = lambda msg: float(msg.split("+ persist ")[1].split()[0].rstrip("),"))  # noqa: E731
    assert ring(str(on.value)) > 1 and replicas(str(on.value)) > 0
    assert ring(str(off.value)) == 0 and replicas(str(off.value)) == 0 and persist(str(off.value)) > 0


def test_the_job_check_counts_ft_replicas():
    from deadpool.launch.memory import check_fits
    from tests.conftest import compose_train

    big = ["model=llama_7b", "parallel=dp4", "memory.host_gb_per_node=0.001"]
    cfg = compose_train(big + ["ft.replicas=3"], "unused")
    with pytest.raises(ValueError, match="replicas") as e:
        check_fits(cfg)
    one = compose_train(big, "unused")
    with pytest.raises(ValueError) as e1:
        check_fits(one)
    replicas = lambda msg: float(msg.split("+ replicas ")[1].split()[0])  # noqa: E731
    assert replicas(str(e1.value)) > 1
    assert replicas(str(e.value)) == pytest.approx(3 * replicas(str(e1.value)), abs=0.1)


def test_first_stage_holds_the_most_activations_under_1f1b():
    m = _load("model", "llama_65b")
    e = estimate(m, dict(dp=16, tp=4, pp=8, zero=True), batch_size=16, seq_len=2048, microbatches=16)
    assert e["stage"] == 0
    # pp micro-batches in flight x n_layers/pp layers: every layer's activations, whatever pp is;
    # pp = 8 holds 4 more micro-batches' stage outputs (T x d fp32) and token ids (9 T bytes)
    e4 = estimate(m, dict(dp=16, tp=4, pp=4, zero=True), batch_size=16, seq_len=2048, microbatches=16)
    tokens = 2048
    assert e["gpu"]["activations"] - e4["gpu"]["activations"] == 4 * (tokens * 8192 * 4 + 9 * tokens)
    half = estimate(m, dict(dp=16, tp=4, pp=8, zero=True), batch_size=16, seq_len=1024, microbatches=16)
    assert half["gpu"]["activations"] * 2 == e["gpu"]["activations"]


def test_bf16_is_the_runtimes_mixed_precision_layout():
    """precision=bf16 as ZeroOptimizer lays it out: bf16 parameters, bf16 gradients plus the fp32
    accumulation buffer (grad_reduce_dtype=fp32, the default), fp32 master weights and both
    moments sharded over dp; activations in bf16."""
    m = _load("model", "llama_65b")
    kw = dict(batch_size=16, seq_len=2048, microbatches=16)
    p = dict(dp=16, tp=4, pp=8, zero=True)
    fp32, bf16 = estimate(m, p, **kw), estimate(m, p, precision="bf16", **kw)
    bf16_grads = estimate(m, p, precision="bf16", grad_reduce_dtype="bf16", **kw)
    n = fp32["gpu"]["params"] // 4  # padded parameters of the worst rank
    assert bf16["gpu"]["params"] == 2 * n
    assert bf16["gpu"]["grads"] == 6 * n and bf16_grads["gpu"]["grads"] == 2 * n
    assert bf16["gpu"]["optimizer"] == 12 * n // 16 + 4
    assert bf16["gpu"]["activations"] < fp32["gpu"]["activations"] / 2 + 1e9  # fp32 softmax
    # the REFERENCE figure for this layout: ~4 GB bf16 weights, ~1.5 GB optimizer shard per rank
    assert bf16["gpu"]["params"] / 1e9 == pytest.approx(4.1, abs=0.2)
    assert bf16["replicated_per_step"] / 1e9 == pytest.approx(1.5, abs=0.1)
    with pytest.raises(ValueError, match="precision"):
        estimate(m, p, precision="fp8", **kw)
    with pytest.raises(ValueError, match="activation_checkpointing"):
        estimate(m, p, activation_checkpointing="most", **kw)


def test_checkpointing_cuts_activations_as_counted():
    """full keeps one T x d tensor per block and micro-batch (plus one block recomputed at a
    time); selective drops one of the MLP's four T x f tensors."""
    m = _load("model", "llama_7b")
    kw = dict(batch_size=8, seq_len=2048, microbatches=8)
    p = dict(dp=8, tp=4, pp=2, zero=True)
    act = {mode: estimate(m, p, activation_checkpointing=mode, **kw)["gpu"]["activations"]
           for mode in ("none", "selective", "full")}
    assert act["full"] < act["selective"] < act["none"]
    tokens, layers = 2048, 16  # stage 0 of 2: 16 layers, 2 micro-batches in flight
    f = model_config(m).ffn_hidden
    assert act["none"] - act["selective"] == 2 * layers * tokens * f // 4 * 4
    assert act["full"] < act["none"] / 5


def _measured_saved_bytes(stage, inp, targets, comm=None):
    """Bytes of the distinct storages autograd saves during one forward of ``stage`` (its
    parameters and buffers excluded)."""
    skip = {t.untyped_storage().data_ptr() for t in [*stage.parameters(), *stage.buffers()]}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        # detached: a saved output returned as itself would hold its own graph node (a cycle
        # that keeps the whole graph, and what it references, alive)
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(inp, comm, targets)
    return sum(seen.values())


GQA = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_mult=2,
           max_seq_len=16)


@pytest.mark.parametrize("cfg", [GQA, dict(GQA, d_model=48, n_kv_heads=4, ffn_mult=3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_count_is_what_autograd_saves_at_tp1(cfg, dtype):
    """The measured path: every stage of pp 1, 2 and 3, every checkpointing mode, fp32 and bf16
    activations, exactly (bytes) what the estimator counts per micro-batch."""
    torch.set_num_threads(1)
    b, t = 2, 16
    g = torch.Generator().manual_seed(0)
    for pp in (1, 2, 3):
        for s in range(pp):
            for mode in ("none", "selective", "full"):
                stage = build_stage(cfg, 0, pp_rank=s, pp=pp, tp_rank=0, tp=1,
                                    activation_checkpointing=mode).to(dtype)
                inp = (torch.randint(0, 64, (b, t), generator=g) if s == 0 else
                       torch.randn(b, t, cfg["d_model"], generator=g).to(dtype).requires_grad_())
                targets = torch.randint(0, 64, (b, t), generator=g) if s == pp - 1 else None
                want = saved_activations(cfg, 1, pp, s, tokens=b * t,
                                         act_bytes=torch.finfo(dtype).bits // 8, mode=mode)
                assert _measured_saved_bytes(stage, inp, targets) == want, (pp, s, mode)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_count_is_what_autograd_saves_at_tp2(mode):
    from tests.deadpool.parallel.test_tensor import master_store, tp_comm

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)
    master = master_store()

    def rank_fn(r):
        torch.set_num_threads(1)
        stage = build_stage(GQA, 0, pp_rank=0, pp=1, tp_rank=r, tp=2, activation_checkpointing=mode)
        return _measured_saved_bytes(stage, x, y, tp_comm(master, r))

    want = saved_activations(GQA, 2, 1, 0, tokens=32, act_bytes=4, mode=mode)
    assert run_threads(rank_fn, 2) == [want, want]


@pytest.mark.parametrize("precision,reduce", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16")])
def test_state_bytes_are_the_built_optimizers(precision, reduce):
    """Parameters, gradients and the optimizer shard of the estimate are the bytes ZeroOptimizer
    allocates for the same stage (dp 2, sharded; padding included): in bf16 the fp32
    accumulation buffer (grad_reduce_dtype=fp32) and the fp32 master shard too."""
    from deadpool.parallel.data.zero import ZeroOptimizer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}
    layout = dict(dp=2, tp=1, pp=1, zero=True)
    gpu = estimate(GQA, layout, batch_size=2, seq_len=16, microbatches=1, precision=precision,
                   grad_reduce_dtype=reduce)["gpu"]
    stage = build_stage(GQA, 0, pp_rank=0, pp=1, tp_rank=0, tp=1).to(dtype[precision])
    opt = ZeroOptimizer(list(stage.parameters()), dp_size=2, dp_rank=1, lr=1e-3,
                        weight_decay=0.1, shard=True, grad_reduce_dtype=dtype[reduce])
    grads = [opt.flat_grads] + ([opt.main_grads] if opt.main_grads is not None else [])
    assert gpu["params"] == opt.flat_params.numel() * opt.flat_params.element_size()
    assert gpu["grads"] == sum(g.numel() * g.element_size() for g in grads)
    assert gpu["optimizer"] == opt.state_nbytes()["unique"]


def test_a_layout_that_does_not_fit_is_refused_naming_the_per_rank_gb(tmp_path):
    cfg = layout_cfg("llama_65b", "llama65b_a100_40g", tmp_path, gpu_gb=A100_GB["40g"])
    with pytest.raises(ValueError, match=r"GPU has 39.4 GB: .* GB over\. Hint: raise parallel\.tp") \
            as info:
        validate(cfg)
    need, over = (float(x) for x in re.search(r"needs ([\d.]+) GB per rank .* ([\d.]+) GB over",
                                               str(info.value)).groups())
    assert need > 39.4 and over == pytest.approx(need - 39.4, abs=0.11)
    # its weight-driven part by hand: LLaMA-65B (d 8192, FFN 22016, 80 layers, vocab 32000) at
    # tp 4, pp 8: 10 layers of (4 d^2 + 3 d f) / 4 plus a vocab shard of d x 32000 / 4 on the
    # first stage (plus norms); fp32 weights and gradients, AdamW's two moments sharded over dp 16
    n = 10 * (4 * 8192**2 + 3 * 8192 * 22016) // 4 + 8192 * 32000 // 4
    gpu = estimate(cfg["model"], cfg["parallel"], batch_size=16, seq_len=2048, microbatches=16)["gpu"]
    assert gpu["params"] == pytest.approx(4 * n, rel=1e-3)
    assert gpu["grads"] == pytest.approx(4 * n, rel=1e-3)
    assert gpu["optimizer"] == pytest.approx(8 * n / 16, rel=1e-3)
    assert need == pytest.approx(gpu["total"] / GiB, abs=0.06)  # the message reports the estimate
    validate(layout_cfg("llama_65b", "llama65b_a100_40g", tmp_path, gpu_gb=39.4,
                        activation_checkpointing="full"))


# as the README table says: (model, GPU) whose layout needs checkpointing (or bf16) in fp32
NEEDS_CHECKPOINTING_IN_FP32 = {("llama_30b", "40g"), ("llama_65b", "40g"), ("llama_65b", "80g"),
                               ("llama2_70b", "40g"), ("llama2_70b", "80g"),
                               ("llama3_70b", "40g"), ("llama3_70b", "80g")}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("gpu", list(A100_GB))
def test_the_layout_files_fit_their_gpus(model, gpu, tmp_path):
    """Every layout fits its GPU in fp32 with full activation checkpointing; without it, all but
    the ones the README table marks."""
    layout = f"{MODELS[model]}_a100_{gpu}"
    cfg = layout_cfg(model, layout, tmp_path, gpu_gb=A100_GB[gpu])
    p = cfg["parallel"]
    assert p["tp"] <= p["ranks_per_node"] == 4 and p["dp"] > 1
    assert p["dp"] * p["tp"] * p["pp"] <= 512
    validate(dict(cfg, activation_checkpointing="full"))
    if (model, gpu) in NEEDS_CHECKPOINTING_IN_FP32:
        with pytest.raises(ValueError, match="does not fit.*activation_checkpointing=full"):
            check_fits(cfg)
    else:
        validate(cfg)


def test_the_job_precision_and_checkpointing_reach_the_check(tmp_path):
    """check_fits reads precision, grad_reduce_dtype and activation_checkpointing from the job:
    LLaMA-65B on its 80 GB layout is refused in fp32 and fits in bf16 (59 GB), or in bf16 with
    bf16 gradient reduction and selective checkpointing."""
    cfg = layout_cfg("llama_65b", "llama65b_a100_80g", tmp_path, gpu_gb=A100_GB["80g"])
    with pytest.raises(ValueError, match="does not fit"):
        check_fits(cfg)
    check_fits(dict(cfg, precision="bf16"))
    check_fits(dict(cfg, precision="bf16", grad_reduce_dtype="bf16",
                    activation_checkpointing="selective"))
    with pytest.raises(ValueError, match="does not fit"):
        check_fits(dict(cfg, precision="bf16", memory={"gpu_gb": 55}))


def test_host_memory_per_node_is_checked_when_given(tmp_path):
    cfg = layout_cfg("llama_13b", "llama13b_a100_40g", tmp_path)
    cfg["memory"] = {"gpu_gb": 39.4, "host_gb_per_node": 64}
    with pytest.raises(ValueError, match=r"host memory per node \(4 ranks x .* a node has 64.0 GB"):
        check_fits(cfg)
    cfg["memory"]["host_gb_per_node"] = 256
    check_fits(cfg)


def test_tiny_3d_layout_on_cpu_passes(tmp_path):
    cfg = compose_train(["parallel=dp2_tp2_pp2"], tmp_path)
    validate(cfg)
    validate(dict(cfg, memory={"gpu_gb": None, "host_gb_per_node": None}))  # nulls: not given


def test_cpu_run_too_big_for_this_machine_is_refused(tmp_path):
    cfg = compose_train(["model=llama_65b", "parallel=dp2"], tmp_path)
    with pytest.raises(ValueError, match=r"2 ranks \+ 1 spare\(s\) .* on this machine need"):
        check_fits(cfg)
    with pytest.raises(ValueError, match=r"on this machine need"):
        check_fits(dict(cfg, memory={"gpu_gb": None}))


def test_readme_shows_the_current_tables():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    assert table() in readme
    measured = measured_table()  # builds the runtime's stages and optimizers, measures them
    assert measured in readme
    assert "(estimated" not in measured and measured.count("(= estimate)") == 12


def test_zero2_gradients_measured_equal_the_estimate_and_shrink_with_dp():
    """ZeRO-2's gradient bytes (the fp32 shard + the peak of staged buckets over a real backward)
    are what ``state_bytes`` counts, and fall with dp; ZeRO-1's do not."""
    from deadpool.launch.memory import state_bytes
    from deadpool.launch.memory_tables import measure_grads

    m = _load("model", "tiny")
    n = stage_params(m, 1, 1, 0)
    got = {}
    for dp in (2, 4):
        for prec in ("fp32", "bf16"):
            for z in (1, 2):
                got[dp, prec, z] = measure_grads(m, dp=dp, micro_bs=1, seq_len=16, precision=prec,
                                                 zero=z, bucket_bytes=1 << 14)
                assert got[dp, prec, z] == state_bytes(n, dp, True, prec, zero=z,
                                                       bucket_bytes=1 << 14)["grads"]
            assert got[dp, prec, 2] < got[dp, prec, 1]
    assert got[4, "bf16", 2] < got[2, "bf16", 2] and got[4, "bf16", 1] == got[2, "bf16", 1]


def test_memory_json_prints_the_worst_ranks_terms_and_zero2_shrinks_grads():
    import json
    import subprocess
    import sys

    def terms(*over):
        p = subprocess.run([sys.executable, "-m", "deadpool.memory", "--json", "model=llama3_8b",
                            "parallel=dp4", "parallel.dp=512", "parallel.ranks_per_node=8",
                            "precision=bf16", "seq_len=8192", "batch_size=1", "device=cuda",
                            "memory.gpu_gb=79.1", *over], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)

    one, two = terms("parallel.zero=1"), terms("parallel.zero=2")
    for t in (one, two):
        assert {"params_gb", "grads_gb", "optimizer_gb", "activations_gb", "total_gb"} <= t.keys()
        assert t["total_gb"] == pytest.approx(sum(t[k] for k in ("params_gb", "grads_gb",
                                                                  "optimizer_gb", "activations_gb",
                                                                  "overhead_gb")), abs=0.01)
    assert (one["zero"], two["zero"]) == (1, 2)
    assert one["grads_gb"] == pytest.approx(6 * 8.03e9 / 2**30, rel=0.01)  # bf16 + fp32, full
    assert two["grads_gb"] < 0.2 and two["params_gb"] == one["params_gb"]
    assert one["total_gb"] > 79.1 > two["total_gb"]  # ZeRO-1 refused, ZeRO-2 fits


def test_zero_stage_is_validated():
    from deadpool.topology import ParallelDims

    for ok, stage in ((True, 1), (1, 1), (False, 0), (0, 0), (2, 2)):
        assert ParallelDims.from_config(dict(dp=2, zero=ok)).zero == stage
    for bad in (3, "yes", 2.5, None, -1):
        with pytest.raises(ValueError, match="parallel.zero must be"):
            ParallelDims.from_config(dict(dp=2, zero=bad))


def test_readme_shows_the_zero2_rows():
    from pathlib import Path

    from deadpool.launch.memory_tables import issue_rows, zero2_table

    readme = (Path(__file__).resolve().parents[2] / "docs" / "memory.md").read_text()
    assert issue_rows() in readme and zero2_table() in readme
