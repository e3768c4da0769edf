"""The prompts acceptance is measured on, held to the promise for bad input before any rank starts: a --prompts
file read strictly (`read_prompts`: a regular file of bounded size, token ids that are integers, every prompt and
answer non-empty) and checked against the target (`check_prompts`: every id in its vocabulary, every prompt and
its answer within its context)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from tpsim.app.request import MAX_TOKENS
from tpsim.base.errors import UsageError, read_regular_text
from tpsim.config.model import ModelConfig


@dataclass(frozen=True)
class Sequence:
    """A prompt and the target's greedy answer: `tokens[:prompt]` the prompt."""

    tokens: tuple[int, ...]
    prompt: int
    text: str = ""

    @property
    def answer(self) -> int:
        return len(self.tokens) - self.prompt


@dataclass(frozen=True)
class Prompts:
    """Where the sequences come from: built-in prompts with their answers, or prompts to answer."""

    sequences: tuple[Sequence, ...]  # answered already (may be empty)
    to_answer: tuple[tuple[int, ...], ...] = ()
    new_tokens: int = 0
    stop: int | None = None
    origin: str = ""


MAX_PROMPTS_BYTES = 16 << 20  # reading stays cheap; far more prompts than a run under the time bound answers
MAX_PROMPTS = 10_000  # sequences in one file (each line's tuple is kept in memory until the checks)
FIX = "give one prompt per line as comma-separated token ids, or tpsim's prompts JSON"
FORMAT = 'tpsim\'s prompts JSON is {"sequences": [{"prompt": [ids], "answer": [ids]}, ...]}'
ID = re.compile(r"-?[0-9]+")  # ASCII digits only: int() also takes "1_0" and non-ASCII digits


def read_prompts(path: Path, new_tokens: int) -> Prompts:
    """A prompts file: JSON `{"sequences": [{"prompt": [ids], "answer": [ids]}, ...]}` (answers kept, as the
    built-in ones), or one prompt per line as comma-separated token ids (answered greedily here)."""
    text = _prompts_text(path)
    if text.lstrip().startswith("{"):
        return Prompts(_json_sequences(path, text), origin=str(path))
    return Prompts((), _line_prompts(path, text), new_tokens, origin=str(path))


def _prompts_text(path: Path) -> str:
    return read_regular_text(path, "--prompts", FIX, MAX_PROMPTS_BYTES)


def _line_prompts(path: Path, text: str) -> tuple[tuple[int, ...], ...]:
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            prompts.append(_line_ids(path, n, line))
        if len(prompts) > MAX_PROMPTS:
            raise UsageError(f"--prompts {path} holds more than {MAX_PROMPTS} prompts; split it into smaller files")
    if not prompts:
        raise UsageError(f"--prompts {path} holds no prompt; {FIX}")
    return tuple(prompts)


def _line_ids(path: Path, n: int, line: str) -> tuple[int, ...]:
    if line.count(",") >= MAX_TOKENS:  # refused before a million ids are parsed
        raise UsageError(f"--prompts {path} line {n} holds more than {MAX_TOKENS} token ids, past any target's "
                         "context; shorten it")
    words = [w.strip() for w in line.split(",")]
    if not all(ID.fullmatch(w) for w in words):
        raise UsageError(f"--prompts {path} line {n}: {line.strip()[:40]!r} is not comma-separated token ids; {FIX}")
    # past int64 (and, far past it, int()'s digit limit): refused before int() reads it
    huge = next((w for w in words if len(w.lstrip("-").lstrip("0")) > 18), None)
    if huge is not None:
        raise UsageError(f"--prompts {path} line {n}: token id {huge[:24]}... is outside any vocabulary; give ids "
                         "from the target's tokenizer")
    return tuple(int(w) for w in words)


def _json_sequences(path: Path, text: str) -> tuple[Sequence, ...]:
    try:
        raw = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise UsageError(f"--prompts {path}: JSON nested too deeply to be tpsim's prompts JSON; {FORMAT}") from None
    except ValueError as e:
        raise UsageError(f"--prompts {path}: not JSON ({e}); {FIX}") from None
    seqs = raw.get("sequences") if isinstance(raw, dict) else None
    if not isinstance(seqs, list) or not seqs:
        raise UsageError(f"--prompts {path} holds no sequences; {FORMAT}")
    if len(seqs) > MAX_PROMPTS:
        raise UsageError(f"--prompts {path} holds more than {MAX_PROMPTS} sequences; split it into smaller files")
    return tuple(_json_sequence(path, n, s) for n, s in enumerate(seqs, 1))


def _no_constant(name: str):
    raise ValueError(f"{name} is not a token id")


def _json_sequence(path: Path, n: int, raw) -> Sequence:
    if not isinstance(raw, dict):
        raise UsageError(f"--prompts {path}: sequence {n} is a {type(raw).__name__}, not an object; {FORMAT}")
    prompt, answer, text = _json_ids(path, n, raw, "prompt"), _json_ids(path, n, raw, "answer"), raw.get("text", "")
    if not isinstance(text, str):
        raise UsageError(f"--prompts {path}: sequence {n}'s \"text\" is a {type(text).__name__}, not a string; "
                         "give the prompt's text or leave it out")
    return Sequence(prompt + answer, len(prompt), text)


def _json_ids(path: Path, n: int, raw: dict, key: str) -> tuple[int, ...]:
    """`raw[key]`: a non-empty list of integers (a float, a boolean or a string is not a token id; a JSON answer
    is the target's, kept as given: prompts to be answered here go one per line)."""
    ids = raw.get(key)
    if not isinstance(ids, list) or not ids:
        got = "missing" if ids is None else "empty" if ids == [] else f"a {type(ids).__name__}"
        more = "; prompts to answer here go one per line as comma-separated ids" if key == "answer" else ""
        raise UsageError(f"--prompts {path}: sequence {n}'s \"{key}\" is {got}, not a list of token ids; "
                         f"{FORMAT}{more}")
    bad = [x for x in ids if type(x) is not int]  # bool is an int subclass: true is not token 1
    if bad:
        shown = f"a {type(bad[0]).__name__}" if isinstance(bad[0], (list, dict)) else json.dumps(bad[0])[:40]
        raise UsageError(f"--prompts {path}: sequence {n}'s \"{key}\" holds {shown}, not a token id (an integer)")
    return tuple(ids)


def check_prompts(prompts: Prompts, cfg: ModelConfig, model: str, where: str) -> None:
    """Every id a token of the target's vocabulary and every prompt with its answer within the target's context
    (`where`: how to name the prompts, e.g. `--prompts FILE`)."""
    items = [(f"sequence {i}", s.tokens, s.prompt, s.answer, "shorten it")
             for i, s in enumerate(prompts.sequences, 1)]
    items += [(f"prompt {i}", p, len(p), prompts.new_tokens, "shorten it or give a smaller --new-tokens")
              for i, p in enumerate(prompts.to_answer, 1)]
    for name, tokens, prompt, answer, fix in items:
        _check_ids(tokens, cfg.vocab_size, model, f"{where}: {name}")
        if prompt + answer > cfg.max_position_embeddings:
            raise UsageError(f"{where}: {name} is {prompt} prompt + {answer} answer tokens, past {model}'s context "
                             f"(max_position_embeddings {cfg.max_position_embeddings}); {fix}")


def _check_ids(tokens: tuple[int, ...], vocab: int, model: str, what: str) -> None:
    bad = next((x for x in tokens if not 0 <= x < vocab), None)
    if bad is not None:
        raise UsageError(f"{what} holds token id {str(bad)[:24]}, outside {model}'s vocabulary (vocab_size {vocab}: "
                         f"ids 0..{vocab - 1}); give ids from the target's tokenizer, or name the draft's target "
                         "with --model")

