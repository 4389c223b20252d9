"""What a request's output must match: a JSON schema, a JSON object, a regex or a Lark grammar
(`Constraint`), read from the flags or from a prompt line's OpenAI-style `response_format`, and
checked by llguidance before any weights load. Torch-free; llguidance is imported only when a
constraint is given (the `structured` extra).

A constraint applies to the generated tokens only (after a --chat template), from the first one, or
from the position after --constrain-after's token (a reasoning end such as `</think>`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from glm5mtp_cli.errors import UserError
from glm5mtp_cli.input_file import read_text

KINDS = ("json_schema", "json_object", "regex", "grammar")
INSTALL = "constraints need llguidance: pip install 'glm5mtp[structured]'"
# compact JSON (json.dumps with separators=(",", ":"), nothing between tokens): a small model given
# free whitespace fills a reply with newlines; a schema's own "x-guidance" options override this
JSON_LAYOUT = {"whitespace_flexible": False}
# json_object is OpenAI's: an object, with any members; another JSON value takes a schema ({} for any)
OBJECT_SCHEMA = '{"type": "object"}'


def llguidance():
    """The llguidance module, or one line saying how to install it."""
    try:
        import llguidance as llg
    except ImportError:
        raise UserError(INSTALL) from None
    return llg


@dataclass(frozen=True)
class Constraint:
    """kind: one of KINDS; text: the schema's JSON, the regex or the Lark grammar ("" for json_object)."""

    kind: str
    text: str = ""

    def grammar(self) -> str:
        """llguidance's grammar for this constraint (LLMatcher takes it with a tokenizer)."""
        m = llguidance().LLMatcher
        if self.kind in ("json_schema", "json_object"):
            return m.grammar_from_json_schema(self.text or OBJECT_SCHEMA, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return m.grammar_from_regex(self.text)
        return m.grammar_from_lark(self.text)

    def describe(self) -> str:
        """A short name for reports: the kind, and the regex itself."""
        return f"regex {self.text}" if self.kind == "regex" else self.kind

    def check(self, where: str) -> "Constraint":
        """One line naming `where` when llguidance refuses the grammar (no tokenizer needed)."""
        error = llguidance().LLMatcher.validate_grammar(self.grammar())
        if error:
            detail = " ".join(error.split()).split(" 1 | ")[0]  # llguidance's message, without its source excerpt
            raise UserError(f"{where}: invalid {self.kind.replace('_', ' ')}: {detail}")
        return self


def _schema_text(schema, where: str) -> str:
    if not isinstance(schema, dict):
        raise UserError(f"{where}: a JSON schema must be a JSON object, got {type(schema).__name__}")
    return json.dumps(schema)


def from_flags(json_schema: Path | None, json_object: bool, regex: str | None, grammar: Path | None) -> Constraint | None:
    """The constraint of --json-schema FILE, --json-object, --regex PATTERN or --grammar FILE (at most one)."""
    given = [f for f, v in (("--json-schema", json_schema), ("--json-object", json_object or None),
                            ("--regex", regex), ("--grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise UserError(f"give at most one constraint, got {' and '.join(given)}")
    if json_schema is not None:
        text = read_text(json_schema, "--json-schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--json-schema {json_schema}: not JSON ({e.msg} at line {e.lineno})") from None
        return Constraint("json_schema", _schema_text(schema, f"--json-schema {json_schema}")).check(f"--json-schema {json_schema}")
    if json_object:
        return Constraint("json_object").check("--json-object")
    if regex is not None:
        return Constraint("regex", regex).check("--regex")
    if grammar is not None:
        return Constraint("grammar", read_text(grammar, "--grammar")).check(f"--grammar {grammar}")
    return None


def from_response_format(obj, where: str) -> Constraint:
    """A prompt line's `response_format` (OpenAI's json_schema and json_object, plus regex and grammar)."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    if kind == "json_schema":
        inner = obj.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if schema is None:
            raise UserError(f'{where}: response_format json_schema needs {{"json_schema": {{"schema": {{...}}}}}}')
        return Constraint("json_schema", _schema_text(schema, where)).check(where)
    if kind == "json_object":
        return Constraint("json_object").check(where)
    if kind == "regex" and isinstance(obj.get("pattern"), str):
        return Constraint("regex", obj["pattern"]).check(where)
    if kind == "grammar" and isinstance(obj.get("grammar"), str):
        return Constraint("grammar", obj["grammar"]).check(where)
    raise UserError(f'{where}: response_format must be {{"type": "json_schema", "json_schema": {{"schema": ...}}}}, '
                    '{"type": "json_object"}, {"type": "regex", "pattern": "..."} or {"type": "grammar", "grammar": "..."}')


def trigger_id(text: str, tokenizer_file: Path | None, vocab_size: int) -> int:
    """--constrain-after's token: `id:N`, or a string the tokenizer holds as one token."""
    if text.startswith("id:"):
        try:
            tid = int(text[3:])
        except ValueError:
            raise UserError(f"--constrain-after {text}: id:N needs an integer") from None
        if not 0 <= tid < vocab_size:
            raise UserError(f"--constrain-after {text}: outside the vocabulary (0..{vocab_size - 1})")
        return tid
    if tokenizer_file is None or not tokenizer_file.is_file():
        raise UserError(f"--constrain-after {text}: the checkpoint has no tokenizer.json; give id:N")
    from tokenizers import Tokenizer

    tid = Tokenizer.from_file(str(tokenizer_file)).token_to_id(text)
    if tid is None or tid >= vocab_size:
        raise UserError(f"--constrain-after {text!r} is not one token of the vocabulary; give id:N for a token id")
    return tid


def check_run(constrained: bool, synthetic: bool, tp: int, has_tokenizer: bool) -> None:
    """What a run with any constraint (a flag's or a prompt line's) refuses, before weights load."""
    if not constrained:
        return
    if synthetic:
        raise UserError("--synthetic-acceptance draws verify decisions, so its output is not the target's: "
                        "it cannot honour a constraint")
    if tp > 1:
        raise UserError("constraints run on one rank: drop --tp or the constraint")
    if not has_tokenizer:
        raise UserError("constraints need the checkpoint's tokenizer.json (the grammar is matched over its tokens)")
