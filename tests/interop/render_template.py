"""Renders chat templates the way Hugging Face transformers does, as the
reference tests/chat_templates.rs compares inferd's renderings with.

The environment is transformers' (`_compile_jinja_template` in
`transformers/utils/chat_template_utils.py`): an ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
filter that is `json.dumps` with ensure_ascii=False, and the globals
`raise_exception(message)` and `strftime_now(format)`. The render call passes
what `apply_chat_template` passes: messages, tools (None unless the job has
them), documents=None,
add_generation_prompt, and the special tokens. Only the clock differs:
`strftime_now` formats a fixed instant (`now`, Unix seconds, UTC) so that
both sides see the same date.

stdin: a JSON list of jobs, each
  {"template": str, "bos_token": str, "eos_token": str, "now": int,
   "messages": [{"role": str, "content": str | null, "tool_calls"?: [...],
                 "tool_call_id"?: str, "name"?: str}, ...],
   "tools": [OpenAI tool, ...] | null (optional),
   "add_generation_prompt": bool}
stdout: a JSON list with one result per job, in order:
  {"text": rendering} | {"raised": message of raise_exception}
  | {"error": "ExceptionType: message"}
"""

import datetime
import json
import sys

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class Raised(jinja2.exceptions.TemplateError):
    """What the template's own raise_exception throws."""


def raise_exception(message):
    raise Raised(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def render(job):
    now = datetime.datetime.fromtimestamp(job["now"], tz=datetime.timezone.utc)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        template = env.from_string(job["template"])
    except Exception as e:  # noqa: BLE001 - every failure is reported
        return {"error": f"{type(e).__name__}: {e}"}
    result = render_messages(template, job, job["messages"])
    if "error" in result:
        # inferd's rule: a template that fails on an assistant turn whose
        # content is None (it only calls tools) is given "" instead.
        filled = [
            dict(m, content="")
            if m.get("tool_calls") and m.get("content") is None
            else m
            for m in job["messages"]
        ]
        if filled != job["messages"]:
            result = render_messages(template, job, filled)
    return result


def render_messages(template, job, messages):
    try:
        text = template.render(
            messages=messages,
            tools=job.get("tools"),
            documents=None,
            add_generation_prompt=job["add_generation_prompt"],
            bos_token=job["bos_token"],
            eos_token=job["eos_token"],
        )
    except Raised as e:
        return {"raised": str(e)}
    except Exception as e:  # noqa: BLE001 - every failure is reported
        return {"error": f"{type(e).__name__}: {e}"}
    return {"text": text}


def main():
    jobs = json.load(sys.stdin)
    json.dump([render(job) for job in jobs], sys.stdout, ensure_ascii=True)


if __name__ == "__main__":
    main()
