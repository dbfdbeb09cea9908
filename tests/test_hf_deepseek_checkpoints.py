"""DeepSeek-V3 (and GLM-4.5) checkpoints as the Hub ships them, beyond what transformers' own model reads:

- the multi-token prediction module, stored as decoder layer `num_hidden_layers` (enorm, hnorm,
  eh_proj, shared_head.norm / head, embed_tokens and a whole decoder layer; transformers ignores
  it): hf-to-ml takes --mtp-num-layers from num_nextn_predict_layers, the round trip is exact, and a
  run from the converted checkpoint starts from HF's main loss and from the MTP loss of a reference
  written here by hand from the HF tensors (the MTP decoder layer run as transformers' own layer),
  which for GLM-4.5 equals the loss of transformers' own MTP drafter (MtpModel);
- FP8 weights (float8_e4m3fn with 128 x 128 fp32 `weight_scale_inv` blocks): dequantized on the way
  in, the logits those of the HF model holding the dequantized weights.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from megatron_lite.data.gpt_dataset import MockGPTDataset, SampleOptions  # noqa: E402
from megatron_lite.parallel.state import ParallelDims  # noqa: E402
from megatron_lite.testing import run_distributed  # noqa: E402
from models.gpt import build_model  # noqa: E402
from models.hf_conversion import (gather_full_state_dict, hf_config_to_model_config,  # noqa: E402
                                  hf_to_megatron_lite, megatron_lite_to_hf)
from test_hf_parity import _DEEPSEEK, _LLAMA, YARN  # noqa: E402
from training_utils import ROOT, logits_of_checkpoint, records_of, train_in_process  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_checkpoint as tool  # noqa: E402

VOCAB, SEQ, BATCH, SEED = _DEEPSEEK["vocab_size"], 16, 4, 1234
N = 2  # decoder layers: one dense, one MoE; the MTP module is HF's layer 2
RUN = ["--mock-data", "--vocab-size", str(VOCAB - 1), "--seq-length", str(SEQ), "--micro-batch-size", "2",
       "--global-batch-size", str(BATCH), "--train-iters", "1", "--eval-iters", "0", "--device", "cpu",
       "--use-checkpoint-args", "--seed", str(SEED)]


MODELS = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM"}


def _config(family: str, layers: int, mtp: int = 1):
    routing = dict(n_group=4, topk_group=2, num_experts_per_tok=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                   num_nextn_predict_layers=mtp)
    if family == "glm4_moe":  # partial RoPE, Q/K/V biases, q/k norms per head
        return transformers.Glm4MoeConfig(**dict(_LLAMA, num_hidden_layers=layers), head_dim=24, attention_bias=True,
                                          use_qk_norm=True, moe_intermediate_size=32, n_routed_experts=8,
                                          n_shared_experts=1, first_k_dense_replace=1, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                           "partial_rotary_factor": 0.5}, **routing)
    return transformers.DeepseekV3Config(**dict(_DEEPSEEK, num_hidden_layers=layers), q_lora_rank=24,
                                         rope_parameters=dict(YARN), **routing)


def _perturbed(build, seed: int):
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
    return model.eval()


@functools.lru_cache(maxsize=None)
def _hub_like(root: str, family: str = "deepseek_v3"):
    """(HF main model, HF model whose layer N is the MTP decoder layer, the MTP module's own tensors,
    directory of the checkpoint as the Hub lays it out: main model + `model.layers.N.*`)."""
    model_class = getattr(transformers, MODELS[family])
    main = _perturbed(lambda: model_class(_config(family, N)), 1)
    longer = _perturbed(lambda: model_class(_config(family, N + 1)), 2)
    root = os.path.join(root, family)
    main.save_pretrained(os.path.join(root, "main"))
    longer.save_pretrained(os.path.join(root, "longer"))
    on_disk = load_file(os.path.join(root, "main", "model.safetensors"))
    layer = f"model.layers.{N}."
    g = torch.Generator().manual_seed(3)
    h = _DEEPSEEK["hidden_size"]
    own = {layer + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           layer + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           layer + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           layer + "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g)}
    on_disk.update({k: v for k, v in load_file(os.path.join(root, "longer", "model.safetensors")).items()
                    if k.startswith(layer)})
    on_disk.update(own, **{layer + "embed_tokens.weight": on_disk["model.embed_tokens.weight"].clone(),
                           layer + "shared_head.head.weight": on_disk["lm_head.weight"].clone()})
    hub = os.path.join(root, "hub")
    main.config.save_pretrained(hub)  # num_nextn_predict_layers=1
    save_file(on_disk, os.path.join(hub, "model.safetensors"))
    return main, longer, own, hub


@pytest.fixture(scope="module")
def hubs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hub"))
    return lambda family="deepseek_v3": _hub_like(root, family)


@pytest.fixture(scope="module")
def hub(hubs):
    return hubs()


def _rms(x, w):
    eps = _DEEPSEEK["rms_norm_eps"]
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_losses(main, longer, own, tokens, labels):
    """(HF's main loss, the MTP loss) by hand from the HF tensors: depth 1 at position t combines the
    main model's normed output at t with the embedding of token t + 1 and predicts label t + 1."""
    from transformers.masking_utils import create_causal_mask

    layer = f"model.layers.{N}."
    with torch.no_grad():
        h = main.model(tokens).last_hidden_state  # after the final norm
        main_loss = F.cross_entropy(main.lm_head(h).reshape(-1, VOCAB), labels.reshape(-1))
        emb = main.model.embed_tokens(tokens[:, 1:])
        x = torch.cat([_rms(emb, own[layer + "enorm.weight"]), _rms(h[:, :-1], own[layer + "hnorm.weight"])], -1)
        x = x @ own[layer + "eh_proj.weight"].t()
        pos = torch.arange(SEQ - 1).unsqueeze(0)
        mask = create_causal_mask(config=longer.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        x = longer.model.layers[N](x, attention_mask=mask, position_ids=pos,
                                   position_embeddings=longer.model.rotary_emb(x, pos))
        logits = main.lm_head(_rms(x, own[layer + "shared_head.norm.weight"]))
        mtp_loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    return main_loss.item(), mtp_loss.item()


def _transformers_mtp_loss(hub_dir: str, tokens, labels) -> float:
    """The MTP loss by transformers' own MtpModel (its speculative-decoding drafter; GLM-4.5 only),
    loaded from the Hub layout: an oracle for the hand-written reference."""
    from transformers.modeling_layers import MtpModel

    main = transformers.Glm4MoeForCausalLM.from_pretrained(hub_dir).eval()
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{N}\..*"]  # it names GLM-4.5's own layers 46 / 92
    mtp = MtpModel.from_pretrained(main).eval()
    with torch.no_grad():
        h = main.model(tokens).last_hidden_state
        x = mtp.forward_layer(0, h[:, :-1], torch.arange(SEQ - 1).unsqueeze(0), None, input_ids=tokens[:, 1:])
        logits = mtp._project_to_logits(x)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels[:, 1:].reshape(-1)).item()


def _first_batch():
    data = MockGPTDataset(VOCAB, SEQ, BATCH, SEED, SampleOptions(eod=VOCAB - 1))
    return (torch.stack([data[i]["tokens"] for i in range(BATCH)]),
            torch.stack([data[i]["labels"] for i in range(BATCH)]))


@pytest.mark.parametrize("family,layout", [("deepseek_v3", "tp1"), ("glm4_moe", "tp1"),
                                           pytest.param("deepseek_v3", "tp2pp2", marks=pytest.mark.slow)])
def test_mtp_module_converts_and_trains_from_hf_losses(hubs, tmp_path, family, layout):
    main, longer, own, hub_dir = hubs(family)
    flags, world = {"tp1": ([], 1), "tp2pp2": (["--tensor-model-parallel-size", "2",
                                                "--pipeline-model-parallel-size", "2"], 4)}[layout]
    ckpt = tmp_path / "ckpt"
    assert tool.main(["hf-to-ml", "--hf-dir", hub_dir, "--out", str(ckpt), *flags]) == 0
    meta = json.load(open(ckpt / "iter_0000000" / "metadata.json"))
    assert meta["model_config"]["mtp_num_layers"] == 1
    first = records_of(run_distributed(train_in_process, world, RUN + flags + ["--load", str(ckpt)]))[0]
    main_loss, mtp_loss = _reference_losses(main, longer, own, *_first_batch())
    if family == "glm4_moe":
        assert abs(_transformers_mtp_loss(hub_dir, *_first_batch()) - mtp_loss) < 1e-5
    assert abs(first["lm_loss"] - main_loss) < 1e-4, (first["lm_loss"], main_loss)
    assert abs(first["mtp_loss"] - mtp_loss) < 1e-4, (first["mtp_loss"], mtp_loss)


@pytest.mark.parametrize("family", list(MODELS))
def test_mtp_module_round_trips_exactly(hubs, family):
    """Hub layout -> ours -> Hub layout identical (the copies of the embedding and the head included);
    ours (our own initialization) -> HF -> ours identical; the config keeps num_nextn_predict_layers."""
    main, _, _, hub_dir = hubs(family)
    on_disk = load_file(os.path.join(hub_dir, "model.safetensors"))
    cfg = hf_config_to_model_config(transformers.AutoConfig.from_pretrained(hub_dir))
    assert cfg.mtp_num_layers == 1
    ours = hf_to_megatron_lite(on_disk, cfg)
    assert any(k.startswith("mtp.layers.0.transformer_layer.mlp.experts.") for k in ours)
    again = megatron_lite_to_hf(ours, cfg, tied_lm_head=False)
    assert again.keys() == on_disk.keys()
    assert all(torch.equal(again[k], v) for k, v in on_disk.items())
    dims = ParallelDims().build_groups()
    fresh = gather_full_state_dict(build_model(cfg, dims, seed=11)[0], dims)
    back = hf_to_megatron_lite(megatron_lite_to_hf(fresh, cfg), cfg)
    assert back.keys() == fresh.keys() and all(torch.equal(back[k], v) for k, v in fresh.items())
    from models.hf_conversion import model_config_to_hf_config
    assert model_config_to_hf_config(cfg).num_nextn_predict_layers == 1


def test_transformers_saved_checkpoint_without_mtp_tensors_converts_without_mtp(hub, tmp_path, capsys):
    """transformers keeps num_nextn_predict_layers in the config it saves but drops the MTP layer."""
    main, _, _, hub_dir = hub
    saved = os.path.join(os.path.dirname(hub_dir), "main")
    assert json.load(open(os.path.join(saved, "config.json")))["num_nextn_predict_layers"] == 1
    assert tool.main(["hf-to-ml", "--hf-dir", saved, "--out", str(tmp_path / "ckpt")]) == 0
    assert json.load(open(tmp_path / "ckpt" / "iter_0000000" / "metadata.json"))["model_config"]["mtp_num_layers"] is None
    assert "converted without them" in capsys.readouterr().out


def _quantized(w: torch.Tensor, block):
    """(float8_e4m3fn weight, fp32 weight_scale_inv, the dequantized weight) as DeepSeek-V3 quantizes:
    each block scaled by its absolute maximum / 448 (e4m3's largest value), the last blocks partial."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    q, scale_inv, dequantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(grid), torch.empty_like(w)
    for i in range(grid[0]):
        for j in range(grid[1]):
            at = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            s = w[at].abs().max().clamp(min=1e-12) / 448.0
            q[at] = (w[at] / s).to(torch.float8_e4m3fn)
            scale_inv[i, j] = s
            dequantized[at] = q[at].float() * s
    return q, scale_inv, dequantized


def test_fp8_block_scaled_weights_are_dequantized_on_the_way_in(hub, tmp_path, capsys):
    """Every linear weight of the layers but the router quantized as DeepSeek-V3 ships them (16 x 32 blocks here, from the config, so that
    the tiny shapes have partial blocks): hf-to-ml gives the weights of the dequantized checkpoint exactly,
    and the logits of transformers' model loaded from the dequantized weights."""
    main, _, _, hub_dir = hub
    saved = os.path.join(os.path.dirname(hub_dir), "main")
    block = (16, 32)
    stored, dequantized = {}, {}
    for name, t in load_file(os.path.join(saved, "model.safetensors")).items():
        if ".layers." in name and t.dim() == 2 and not name.endswith(("layernorm.weight", "mlp.gate.weight")):
            q, scale_inv, dequantized[name] = _quantized(t, block)
            stored.update({name: q, name + "_scale_inv": scale_inv})
        else:
            stored[name] = dequantized[name] = t
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert stored[kv_a].shape[0] % block[0] and stored[kv_a + "_scale_inv"].shape[0] == 2  # a partial block
    assert not torch.equal(dequantized[kv_a], load_file(os.path.join(saved, "model.safetensors"))[kv_a])
    fp8_dir, plain_dir = tmp_path / "fp8", tmp_path / "dequantized"
    config = main.config.to_dict()
    for where, weights, quant in ((fp8_dir, stored, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                     "dynamic", "weight_block_size": list(block)}),
                                  (plain_dir, dequantized, None)):
        os.makedirs(where)
        json.dump(dict(config, **({"quantization_config": quant} if quant else {})), open(where / "config.json", "w"))
        save_file(weights, str(where / "model.safetensors"))
    assert tool.main(["hf-to-ml", "--hf-dir", str(fp8_dir), "--out", str(tmp_path / "ckpt")]) == 0
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours, _, state = logits_of_checkpoint(tmp_path / "ckpt", tokens)
    ours = ours[..., :VOCAB]
    cfg = hf_config_to_model_config(main.config)
    expected_state = hf_to_megatron_lite(dequantized, dataclasses.replace(cfg, mtp_num_layers=None))
    assert all(torch.equal(state[k], v) for k, v in expected_state.items())
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(plain_dir).eval()
    with torch.no_grad():
        expected = reference(tokens).logits.float()
    assert (ours - expected).abs().max().item() < 1e-4

    # an FP8 weight whose config does not say how it is scaled; a quantization no table reads
    json.dump(config, open(fp8_dir / "config.json", "w"))
    assert tool.main(["hf-to-ml", "--hf-dir", str(fp8_dir), "--out", str(tmp_path / "bad")]) == 2
    assert "without" in capsys.readouterr().err
    json.dump(dict(config, quantization_config={"quant_method": "awq"}), open(fp8_dir / "config.json", "w"))
    assert tool.main(["hf-to-ml", "--hf-dir", str(fp8_dir), "--out", str(tmp_path / "bad2")]) == 2
    assert "quant_method 'awq' is not supported" in capsys.readouterr().err
