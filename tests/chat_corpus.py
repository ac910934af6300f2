"""A small chat corpus for the tests that train on chat data (tests/dist, tests/gpu)."""

import json
import random
import shutil
from pathlib import Path

from paraseek.models.tokenizer import BUNDLED_TOKENIZER

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
WORDS = "the devil a dictionary of wit and wisdom in which every word is defined by its worst use".split()


def chat_corpus(folder: Path, n: int = 48) -> None:
    """folder/chat.jsonl: n conversations of 1-3 turns (some with a system prompt); folder/tok: the bundled tokenizer
    with DeepSeek-LLM-7B-chat's template (which names only bos and eos, so the tiny models' 2,048 ids suffice)."""
    (folder / "tok").mkdir()
    shutil.copy(BUNDLED_TOKENIZER, folder / "tok" / "tokenizer.json")
    template = (TEMPLATES / "deepseek_llm_7b_chat.jinja").read_text(encoding="utf-8")
    (folder / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": template}))
    rng = random.Random(0)

    def say(n):
        return " ".join(rng.choice(WORDS) for _ in range(n))

    with open(folder / "chat.jsonl", "w") as f:
        for i in range(n):
            messages = [{"role": "system", "content": say(3)}] if i % 3 == 0 else []
            for _ in range(1 + i % 3):
                messages += [{"role": "user", "content": say(rng.randint(2, 8))},
                             {"role": "assistant", "content": say(rng.randint(2, 10))}]
            f.write(json.dumps({"messages": messages}) + "\n")
