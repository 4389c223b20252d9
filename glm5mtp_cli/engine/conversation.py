"""`generate --conversation`: multi-turn chats, each turn's reply appended before the next turn.

Turns are scheduled round-robin over conversations (turn 1 of every chat, then turn 2, ...), as a
server interleaves chats, so held carries compete for --carry-budget. Each turn's prompt token ids
extend the previous turn's ids exactly (history + reply + the new user text), so carried rows are
reused without re-tokenising the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from glm5mtp_cli.engine.carry import CARRY_MODES, CarryStore
from glm5mtp_cli.engine.config import EngineConfig
from glm5mtp_cli.errors import UserError
from glm5mtp_cli.jsonl import read_jsonl
from glm5mtp_cli.prompts import NO_TOKENIZER
from glm5mtp_cli.engine.runtime import Runtime, make_engine, resolve
from glm5mtp_cli.engine.sequence import Request, budget_tokens


@dataclass
class Turn:
    prompt: list[int]
    tokens: list[int]
    ttft_s: float
    prefilled_target_rows: int
    prefilled_drafter_rows: int
    carried_target_rows: int
    carried_drafter_rows: int
    finish_reason: str
    trace: list[dict] = field(default_factory=list)  # the engine's verify steps of this turn (--trace)


@dataclass
class Chat:
    turns_in: list  # user texts (str) or token id lists
    messages: list[dict] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the last turn's prompt + reply
    prompt_text: str = ""  # the last turn's rendered prompt (chat template)
    reply_text: str = ""
    turns: list[Turn] = field(default_factory=list)


def read_conversations(path: Path) -> list[list]:
    convs = []
    for n, obj in enumerate(read_jsonl(path), 1):
        turns = obj.get("turns")
        ok = isinstance(turns, list) and turns and all(
            isinstance(t, str) or (isinstance(t, list) and t and all(isinstance(x, int) for x in t)) for t in turns)
        if not ok:
            raise UserError(f'{path}: entry {n} needs {{"turns": [...]}}: user texts, or token id lists')
        convs.append(turns)
    return convs


def next_prompt(rt: Runtime, chat: Chat, user, use_template: bool) -> list[int]:
    """The ids of this turn's prompt: previous ids + reply (already in chat.ids) + the new user part."""
    if isinstance(user, list):
        return chat.ids + list(user)
    if rt.tokenizer is None:
        raise UserError(f"{rt.resolved.folder}: {NO_TOKENIZER}; give turns as token id lists")
    if not use_template:
        return chat.ids + rt.tokenizer.encode(user if not chat.ids else "\n" + user)
    chat.messages.append({"role": "user", "content": user})
    text = rt.tokenizer.apply_chat_template(chat.messages)
    prev, chat.prompt_text = chat.prompt_text + chat.reply_text, text
    # the part of the rendered chat that this turn adds after the previous prompt + reply
    if chat.ids and text.startswith(prev):
        return chat.ids + rt.tokenizer.encode(text[len(prev):])
    return rt.tokenizer.encode(text)  # first turn, or a template that is not append-only


def _record_reply(rt: Runtime, chat: Chat, prompt: list[int], tokens: list[int]) -> None:
    chat.ids = prompt + tokens
    if chat.messages and rt.tokenizer is not None:
        chat.reply_text = rt.tokenizer.decode(tokens)
        chat.messages.append({"role": "assistant", "content": chat.reply_text})


def check_carry_flags(carry: str, carry_budget: int | None) -> None:
    if carry not in CARRY_MODES:
        raise UserError(f"--carry must be one of {', '.join(CARRY_MODES)}, got {carry!r}")
    if carry_budget is not None and carry_budget < 0:
        raise UserError(f"--carry-budget must be >= 0, got {carry_budget}")


def run_conversations(rt: Runtime, convs: list[list], config: EngineConfig, carry: str, carry_budget: int | None,
                      use_template: bool) -> tuple[list[Chat], dict]:
    """Every turn of every chat (round-robin), each turn through the engine `config` describes."""
    check_carry_flags(carry, carry_budget)
    config = resolve(rt, config)
    gamma, max_new_tokens, max_seq_len = config.gamma, config.max_new_tokens, config.max_seq_len
    # Every chat may hold a carry while one turn runs: size the pools for all of them at their longest.
    longest = max(sum(len(t) if isinstance(t, list) else 4 * len(t) + 8 for t in c) + len(c) * (max_new_tokens + gamma)
                  for c in convs)
    per_seq = min(max_seq_len, budget_tokens(longest, 0, 0)) if config.alloc == "budget" else max_seq_len
    pools = rt.make_pools(per_seq, len(convs) + 1)
    engine = make_engine(rt, pools, config)
    store = CarryStore(engine.head, carry_budget)
    chats = [Chat(list(c)) for c in convs]
    try:
        for k in range(max(len(c.turns_in) for c in chats)):
            for ci, chat in enumerate(chats):
                if k >= len(chat.turns_in):
                    continue
                prompt = next_prompt(rt, chat, chat.turns_in[k], use_template)
                last = k == len(chat.turns_in) - 1
                req = Request(prompt, max_new_tokens, ci, carry=store.take(ci) if carry != "none" else None,
                              carry_mode="none" if last else carry)
                res = engine.generate([req])[0]
                if res.carry_out is not None:
                    store.put(ci, res.carry_out)
                chat.turns.append(Turn(prompt, res.tokens, res.ttft_s, res.prefilled_target_rows,
                                       res.prefilled_drafter_rows, res.carried_target_rows,
                                       res.carried_drafter_rows, res.finish_reason, res.trace))
                _record_reply(rt, chat, prompt, res.tokens)
    finally:
        engine.close()
        store.clear()
    leftover = pools.blocks_held()
    if any(leftover.values()):
        raise RuntimeError(f"cache blocks still held after the conversations: {leftover}")
    return chats, {"mode": carry, "evictions": store.evictions, "pool_bytes": pools.bytes_total(),
                   "carry_budget": carry_budget, "blocks_per_seq": math.ceil(per_seq / 16)}
