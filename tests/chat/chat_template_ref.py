"""Chat templates rendered by transformers (the contract of src/meshtrain/data/chat_template.h).

  render TEMPLATE_DIR CONVERSATIONS.json OUT.json
      every *.jinja in TEMPLATE_DIR x every conversation x add_generation_prompt False/True,
      rendered by transformers.utils.chat_template_utils.render_jinja_template (what
      apply_chat_template runs: jinja2's ImmutableSandboxedEnvironment with trim_blocks,
      lstrip_blocks, loop controls, its tojson, raise_exception, strftime_now) with
      bos_token "<s>", eos_token "</s>" and strftime_now pinned to NOW (UTC).
      OUT.json: [{template, conversation, add_generation_prompt, status, text|error}], where
      status is "ok", "raise" (the template called raise_exception) or "error" (jinja2 failed).

  masks MODEL_DIR CONVERSATIONS.jsonl OUT.jsonl
      each conversation (a list of messages, or {"messages": [...]}) through
      AutoTokenizer.from_pretrained(MODEL_DIR).apply_chat_template(tokenize=True,
      return_dict=True, return_assistant_tokens_mask=True): one {"input_ids", "assistant_masks"}
      line each (the template must have {% generation %} blocks).

Runs in build/hf-venv (scripts/setup_hf_venv.sh); TZ=UTC is set here.
"""
import datetime
import json
import os
import sys
from pathlib import Path

os.environ["TZ"] = "UTC"
import time  # noqa: E402

time.tzset()

import jinja2  # noqa: E402
from transformers.utils import chat_template_utils  # noqa: E402

NOW = 1721995200  # 2024-07-26 12:00:00 UTC; tests/chat/chat_template_test.cpp pins the same
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


class PinnedDatetime(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime.fromtimestamp(NOW, tz)


chat_template_utils.datetime = PinnedDatetime


def render(template, messages, add_generation_prompt):
    try:
        texts, _ = chat_template_utils.render_jinja_template(
            conversations=[messages], chat_template=template,
            add_generation_prompt=add_generation_prompt, **SPECIAL)
        return {"status": "ok", "text": texts[0]}
    except Exception as e:  # noqa: BLE001 - every failure is a recorded outcome
        # raise_exception raises exactly jinja2's TemplateError; its subclasses are jinja2's own.
        status = "raise" if type(e) is jinja2.exceptions.TemplateError else "error"
        return {"status": status, "error": f"{type(e).__name__}: {e}"}


def masks(model_dir, conversations, out):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with open(conversations, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for line in f:
            c = json.loads(line)
            messages = c["messages"] if isinstance(c, dict) else c
            r = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
            o.write(json.dumps({"input_ids": list(r["input_ids"]),
                                "assistant_masks": list(r["assistant_masks"])}) + "\n")


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "masks":
        return masks(*sys.argv[2:])
    if len(sys.argv) != 5 or sys.argv[1] != "render":
        sys.exit(__doc__)
    template_dir, conversations, out = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(conversations, encoding="utf-8") as f:
        convs = json.load(f)
    records = []
    for path in sorted(template_dir.glob("*.jinja")):
        template = path.read_text(encoding="utf-8")
        for name, messages in convs.items():
            for agp in (False, True):
                r = {"template": path.name, "conversation": name, "add_generation_prompt": agp}
                r.update(render(template, messages, agp))
                records.append(r)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(records, f, ensure_ascii=False, indent=0)
        f.write("\n")


if __name__ == "__main__":
    main()
