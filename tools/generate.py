#!/usr/bin/env python
"""Generate text from a training checkpoint (`pretrain_gpt.py --save DIR`), at any TP size.

    python tools/generate.py --load ckpt --prompt "def "
    torchrun --nproc_per_node=2 tools/generate.py --load ckpt --tensor-model-parallel-size 2 \\
        --prompt "import " --prompt "class " --max-new-tokens 64 --temperature 0.8 --top-p 0.9 --json

The model's shape comes from the checkpoint; so do its tokenizer (override with --tokenizer-type
and its files) and its precision (override with --fp32 / --bf16 / --fp16). Text goes to stdout as
it is produced (at --batch-size 1; larger batches print each text when its batch is done);
`--json` prints instead one JSON object per prompt: the prompt and generated token ids, the
model's log-probability of each generated token, and the text. NullTokenizer prompts are
space-separated token ids. Sampling is the default (--temperature 1, no top-k / top-p, as in
Megatron-LM); --greedy takes the most likely token. Generation stops after the end-of-document
token or --max-new-tokens. Every TP rank runs the same loop; rank 0 prints. Errors are one
line on stderr, exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, TextIO

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from megatron_lite.errors import ConfigError  # noqa: E402


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Generate text from a megatron-lite training checkpoint", allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint root (its latest iteration) or an iter_* directory")
    p.add_argument("--ckpt-step", type=int, default=None, help="this iteration instead of the latest")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", default=None,
                   help="one prompt per line (a line that is a JSON string literal is decoded, so a prompt can "
                        "hold newlines); blank lines are skipped")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per prompt at most (default: 128, or fewer so that prompt and "
                        "completion fit the sequence length the model was trained at)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts generated together (left-padded)")
    s = p.add_argument_group("sampling")
    s.add_argument("--greedy", action="store_true", help="always the most likely token")
    s.add_argument("--temperature", type=float, default=1.0, help="divides the logits before sampling")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens holding probability p (0 or 1: all)")
    s.add_argument("--seed", type=int, default=1234, help="seed of the sampling")
    m = p.add_argument_group("model")
    m.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (= the number of ranks)")
    m.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="must be 1 (TP only)")
    m.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    precision = m.add_mutually_exclusive_group()
    for flag in ("--fp32", "--bf16", "--fp16"):
        precision.add_argument(flag, action="store_const", const=flag[2:], dest="precision",
                               help=f"compute in {flag[2:]} (default: the checkpoint's precision)")
    m.add_argument("--attention-backend", choices=["auto", "sdpa", "local", "flash"], default=None,
                   help="core attention (default: the checkpoint's)")
    t = p.add_argument_group("tokenizer (default: the checkpoint's)")
    for flag in ("--tokenizer-type", "--tokenizer-model", "--vocab-file", "--merge-file"):
        t.add_argument(flag, default=None)
    t.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer's vocabulary")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt instead of the text")
    return p


# --- setup (every error here comes before any process group exists) --------------------------
def read_prompts(args) -> List[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise ConfigError(f"--prompt-file {args.prompt_file}: {e.strerror}") from e
        prompts += [_decode_line(line) for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompt-file")
    if "" in prompts:
        raise ConfigError(f"prompt {prompts.index('')} is empty: give it some text to continue")
    return prompts


def _decode_line(line: str) -> str:
    if line.startswith('"'):
        try:
            value = json.loads(line)
        except ValueError:
            return line
        return value if isinstance(value, str) else line
    return line


def build_tokenizer_for(args, data):
    """The tokenizer of the flags, else of the checkpoint's run."""
    from megatron_lite.data import build_tokenizer

    given = args.tokenizer_type is not None
    pick = (lambda flag, saved: flag if given else saved)
    return build_tokenizer(pick(args.tokenizer_type, data.tokenizer_type),
                           tokenizer_model=pick(args.tokenizer_model, data.tokenizer_model),
                           vocab_file=pick(args.vocab_file, data.vocab_file),
                           merge_file=pick(args.merge_file, data.merge_file),
                           vocab_size=pick(args.vocab_size, data.vocab_size))


def tokenize(tokenizer, text: str) -> List[int]:
    try:
        return tokenizer.tokenize(text)
    except ValueError as e:  # NullTokenizer: a prompt that is not space-separated ids
        raise ConfigError(f"{tokenizer.name} cannot tokenize prompt {text!r}: {e}") from e


def check_layout(args, model_cfg, world_size: int) -> None:
    from megatron_lite.config import ParallelConfig
    from megatron_lite.inference.generation import check_generation_layout

    tp = args.tensor_model_parallel_size
    check_generation_layout(model_cfg, tp, args.pipeline_model_parallel_size)
    if world_size != tp:
        raise ConfigError(f"{world_size} ranks but --tensor-model-parallel-size {tp}: generation runs on "
                          f"tensor-parallel ranks only (start as many ranks as the TP size)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size ({args.batch_size}) must be >= 1")
    ParallelConfig(tensor_model_parallel_size=tp).validate(world_size, model_cfg, seq_length=1)


class Setup:
    """Everything resolved from the flags and the checkpoint, before any process group."""

    def __init__(self, args):
        from megatron_lite.checkpoint.model_only import run_config
        from megatron_lite.inference import SamplingParams
        from megatron_lite.inference.generation import check_prompts

        self.args = args
        self.cfg, meta = run_config(args.load, args.ckpt_step)
        # A converted (weights-only) checkpoint has no training run, hence no trained length.
        self.trained_length = self.cfg.training.seq_length if "training" in meta["config"] else None
        model = self.cfg.model
        if args.attention_backend:
            model.attention_backend = args.attention_backend
        self.tokenizer = build_tokenizer_for(args, self.cfg.data)
        if self.tokenizer.vocab_size != model.tokenizer_vocab:
            raise ConfigError(f"{self.tokenizer.name} has vocab {self.tokenizer.vocab_size} but the checkpoint's model "
                              f"{model.tokenizer_vocab}: pass the --tokenizer-type / --tokenizer-model it was trained "
                              f"with (NullTokenizer: --vocab-size {model.tokenizer_vocab - 1})")
        self.texts = read_prompts(args)
        self.prompts = [tokenize(self.tokenizer, t) or [self.tokenizer.eod] for t in self.texts]
        self.max_new_tokens = self._max_new_tokens(args.max_new_tokens)
        check_prompts(model, self.prompts, self.max_new_tokens)
        check_layout(args, model, int(os.environ.get("WORLD_SIZE", "1")))
        self.sampling = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                                       top_p=args.top_p or 1.0, seed=args.seed)
        t = self.cfg.training
        self.precision = args.precision or ("bf16" if t.bf16 else "fp16" if t.fp16 else "fp32")

    def _max_new_tokens(self, requested: Optional[int]) -> int:
        trained = self.trained_length
        if trained is None:
            return requested or 128
        longest = max(len(p) for p in self.prompts)
        room = trained - longest
        if longest > trained and int(os.environ.get("RANK", "0")) == 0:
            print(f"> warning: a prompt of {longest} tokens is longer than the {trained} tokens the model was trained "
                  f"on (its --seq-length): expect worse text", file=sys.stderr)
        elif (requested or 0) > room and int(os.environ.get("RANK", "0")) == 0:
            print(f"> note: prompt and completion go past the {trained} tokens the model was trained on: expect "
                  f"worse text from there on", file=sys.stderr)
        return requested if requested is not None else min(128, max(1, room))


# --- output -----------------------------------------------------------------------------------
class TextStream:
    """Writes a completion's text as its tokens come. The whole sequence is detokenized each
    time and the new suffix written, so tokenizers whose pieces depend on their neighbours
    (SentencePiece spaces, byte-level UTF-8) print exactly the final text; a trailing incomplete
    character is held back until the next token completes it."""

    def __init__(self, tokenizer, prompt_ids: List[int], out: Optional[TextIO]):
        self.tokenizer, self.out = tokenizer, out
        self.ids = list(prompt_ids)
        self.base = tokenizer.detokenize(self.ids)
        self.generated: List[int] = []
        self.written = 0

    def text(self) -> str:
        gen = [t for t in self.generated if t != self.tokenizer.eod]
        full = self.tokenizer.detokenize(self.ids + gen)
        return full[len(self.base):] if full.startswith(self.base) else self.tokenizer.detokenize(gen)

    def push(self, token: int) -> None:
        self.generated.append(token)
        text = self.text()
        if not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> None:
        self._write(self.text())
        if self.out is not None:
            self.out.write("\n\n")
            self.out.flush()

    def _write(self, text: str) -> None:
        if self.out is not None and len(text) > self.written:
            self.out.write(text[self.written:])
            self.out.flush()
        self.written = max(self.written, len(text))


def completion_text(tokenizer, prompt_ids: List[int], tokens: List[int]) -> str:
    stream = TextStream(tokenizer, prompt_ids, None)
    stream.generated = list(tokens)
    return stream.text()


def json_record(text: str, prompt_ids: List[int], completion, tokenizer) -> dict:
    stopped = bool(completion.tokens) and completion.tokens[-1] == tokenizer.eod
    return {"prompt": text, "prompt_ids": prompt_ids, "ids": completion.tokens, "logprobs": completion.logprobs,
            "text": completion_text(tokenizer, prompt_ids, completion.tokens),
            "finish_reason": "eod" if stopped else "length"}


# --- run --------------------------------------------------------------------------------------
def build_and_load(setup: Setup, device):
    import torch

    from megatron_lite.checkpoint.model_only import load_model_weights
    from megatron_lite.inference import inference_context
    from megatron_lite.parallel.state import ParallelDims
    from models.gpt import build_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[setup.precision]
    dims = ParallelDims.from_world(tp=setup.args.tensor_model_parallel_size)
    model = build_model(setup.cfg.model, inference_context(setup.cfg.model, dims, dtype, device))[0]
    load_model_weights([model], setup.cfg.model, setup.args.load, setup.args.ckpt_step, device=device)
    return model


def run(setup: Setup, model, out: Optional[TextIO]) -> None:
    """Generate every prompt, `--batch-size` at a time; write to `out` (None: write nothing)."""
    from megatron_lite.inference import generate

    args, tok = setup.args, setup.tokenizer
    for start in range(0, len(setup.prompts), args.batch_size):
        texts, ids = setup.texts[start:start + args.batch_size], setup.prompts[start:start + args.batch_size]
        stream = TextStream(tok, ids[0], out) if args.batch_size == 1 and not args.json and out is not None else None
        if stream is not None:
            out.write(texts[0])
        completions = generate(model, ids, setup.max_new_tokens, setup.sampling, eod=tok.eod,
                               on_token=(lambda i, token: stream.push(token)) if stream is not None else None,
                               first_index=start)
        if stream is not None:
            stream.finish()
        elif out is not None:
            for text, prompt_ids, completion in zip(texts, ids, completions):
                out.write(json.dumps(json_record(text, prompt_ids, completion, tok)) + "\n" if args.json
                          else text + completion_text(tok, prompt_ids, completion.tokens) + "\n\n")
            out.flush()


def work(setup: Setup, device) -> None:
    import torch

    from megatron_lite.launch import is_printing_rank

    with torch.no_grad():
        model = build_and_load(setup, device)
        if is_printing_rank():
            from megatron_lite.inference import kv_cache_bytes_per_token
            from megatron_lite.inference.kv_cache import recurrent_state_bytes
            state = recurrent_state_bytes(model)  # linear-attention layers: a fixed size per sequence
            print(f"> KV cache: {kv_cache_bytes_per_token(model)} bytes per token per sequence on each TP rank"
                  + (f", plus {state} bytes of recurrent state per sequence" if state else ""), file=sys.stderr)
        run(setup, model, sys.stdout if is_printing_rank() else None)


def main(argv: Optional[List[str]] = None) -> int:
    from megatron_lite.launch import launch

    return launch(lambda: Setup(build_parser().parse_args(argv)), lambda setup: setup.args.device, work)


if __name__ == "__main__":
    sys.exit(main())
