"""Chat and prompt/completion rows as token ids with a role per token: what supervised fine-tuning trains on.

Rows (a .jsonl line or a .parquet row):
  {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": ...}, ...], "tools": [...]}
      OpenAI's format (`tools` optional), rendered with the tokenizer folder's chat template by the renderer the
      server uses (models/tokenizer.py: transformers' apply_chat_template, token for token).
  {"prompt": "...", "completion": "..."}
      plain text, no template (TRL's "standard" prompt-completion): the prompt's ids (with the bos the tokenizer's
      post-processor adds, if any), the completion's ids, then eos; each part tokenized on its own, so the boundary
      between them is exact.
  {"prompt": [messages], "completion": [messages]}
      TRL's conversational prompt-completion: rendered as one chat, trained on the completion's assistant turns.

Every token gets a role: CONTEXT (system, user and tool turns, the template's own text), ASSISTANT (an assistant
turn's span as the renderer locates it: the tagged {% generation %} text, or the content plus the end-of-turn token
written right after it) or LAST (the last assistant turn). `--loss-on` picks the targets from the roles at load time
(train/dataset.py), so the cached tokens serve every choice. A token belongs to a span when it holds any of the span's
characters, as transformers' `return_assistant_tokens_mask` marks them (char_to_token of the span's first and last
character, and every token between).
"""

from __future__ import annotations

from paraseek.errors import UserError

CONTEXT, ASSISTANT, LAST = 0, 1, 2
LOSS_ON = ("assistant", "all", "last-turn")
KINDS = ("messages", "prompt")  # the keys that make a row a chat row ("text" makes it a document)


def row_kind(row: dict) -> str | None:
    """"chat" for messages or prompt/completion rows, "text" for text rows, None for neither."""
    if "messages" in row or "prompt" in row:
        return "chat"
    return "text" if isinstance(row.get("text"), str) else None


class ChatEncoder:
    """Rows -> (ids, roles) with one TextTokenizer (models/tokenizer.py)."""

    def __init__(self, tok):
        self.tok = tok
        stops = ([tok.eos_token_id] if tok.eos_token_id is not None else []) + list(tok.stop_token_ids)
        # The end-of-turn strings a span is extended over, longest first so that no prefix of one wins.
        self.end_of_turn = tuple(sorted({tok.tok.id_to_token(i) for i in stops if tok.tok.id_to_token(i)},
                                        key=len, reverse=True))

    def encode(self, row: dict, where: str) -> tuple[list[int], list[int], int]:
        """(ids, role per token, assistant turns that got no span: tool calls under a template without
        {% generation %} tags, whose content is null and so cannot be located)."""
        try:
            if "messages" in row:
                return self._chat(_messages(row["messages"], "messages"), row.get("tools"), first_trained=0)
            prompt, completion = row.get("prompt"), row.get("completion")
            if isinstance(prompt, str) and isinstance(completion, str):
                return self._text_pair(prompt, completion)
            if isinstance(prompt, list) and isinstance(completion, list):
                prompt, completion = _messages(prompt, "prompt"), _messages(completion, "completion")
                return self._chat(prompt + completion, row.get("tools"), first_trained=len(prompt))
            raise UserError('"prompt" and "completion" must both be strings or both be lists of messages')
        except UserError as e:
            raise UserError(f"{where}: {e}") from None

    def _text_pair(self, prompt: str, completion: str) -> tuple[list[int], list[int], int]:
        if self.tok.eos_token_id is None:
            raise UserError(f"the tokenizer {self.tok.name} names no eos token to end a completion with")
        head = self.tok.encode(prompt, add_special_tokens=True)
        tail = self.tok.encode(completion, add_special_tokens=False) + [self.tok.eos_token_id]
        return head + tail, [CONTEXT] * len(head) + [LAST] * len(tail), 0

    def _chat(self, messages: list[dict], tools, first_trained: int) -> tuple[list[int], list[int], int]:
        text, spans = self.tok.render_chat_with_spans(messages, tools=tools, through=self.end_of_turn)
        enc = self.tok.tok.encode(text, add_special_tokens=False)
        # Marker spans (a template without {% generation %} tags) are one per assistant message with string
        # content, in order; tagged spans are the template's and need not be.
        located = [i for i, m in enumerate(messages) if m["role"] == "assistant" and isinstance(m["content"], str)]
        per_message = len(spans) == len(located)
        unlocated = sum(m["role"] == "assistant" for m in messages) - len(located) if per_message else 0
        if first_trained:  # the completion's assistant turns are those after the prompt's
            if not per_message:
                raise UserError("the template's {% generation %} spans do not match the assistant messages one to "
                                "one, so the completion's cannot be told from the prompt's; give the row as messages")
            spans = [s for s, i in zip(spans, located) if i >= first_trained]
        roles = [CONTEXT] * len(enc.ids)
        for k, (a, b) in enumerate(spans):
            first, last = enc.char_to_token(a), enc.char_to_token(b - 1) if b > a else None
            if first is None or last is None:  # an empty span, or characters the normalizer removed
                continue
            for t in range(first, last + 1):
                roles[t] = LAST if k == len(spans) - 1 else ASSISTANT
        return enc.ids, roles, unlocated


def _messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise UserError(f'"{key}" must be a non-empty list of {{role, content}} objects')
    # Parquet structs give every message every field, None where a row has none: drop those (content aside) so
    # that templates testing `'tool_calls' in message` see the message as it was written.
    return [{k: v for k, v in m.items() if v is not None or k == "content"} if isinstance(m, dict) else m
            for m in value]
