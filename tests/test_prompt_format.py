"""task.chat / task.system: how a task's prompts reach the tokenizer (rlvr.tokenizer.encode_example,
rlvr.run.prompt_format)."""

import pytest

from rlvr import config as config_mod
from rlvr.run import RunError, prompt_format
from rlvr.tasks import Example, Task
from rlvr.tokenizer import CharTokenizer, PromptFormat, encode_example


class ChatTok:
    """A tokenizer with a chat template: shows what it was asked to encode."""

    has_chat_template = True

    def __init__(self, fmt: PromptFormat | None = None):
        if fmt is not None:
            self.prompt_format = fmt

    def encode_prompt(self, prompt):
        return ("chat", prompt) if isinstance(prompt, list) else ("plain", prompt)


PLAIN = Example(prompt="2+2=", answer="4")
MESSAGES = Example(prompt="2+2=", answer="4", meta={"messages": [{"role": "user", "content": "What is 2+2?"}]})
OWN_SYSTEM = Example(prompt="2+2=", answer="4", meta={"messages": [{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "2+2?"}]})


def test_messages_mode_templates_the_tasks_messages_only():
    for tok in (ChatTok(), ChatTok(PromptFormat())):                   # the default is `messages`
        assert encode_example(tok, PLAIN) == ("plain", "2+2=")
        assert encode_example(tok, MESSAGES) == ("chat", MESSAGES.meta["messages"])


def test_user_mode_sends_a_plain_prompt_as_one_user_turn():
    tok = ChatTok(PromptFormat(chat="user"))
    assert encode_example(tok, PLAIN) == ("chat", [{"role": "user", "content": "2+2="}])
    assert encode_example(tok, MESSAGES) == ("chat", MESSAGES.meta["messages"])   # the task's own turns


def test_off_mode_sends_the_text_even_when_the_task_gives_messages():
    tok = ChatTok(PromptFormat(chat="off"))
    assert encode_example(tok, PLAIN) == ("plain", "2+2=")
    assert encode_example(tok, MESSAGES) == ("plain", "2+2=")


def test_system_message_goes_first_unless_the_task_has_one():
    sys_turn = {"role": "system", "content": "Answer with a number."}
    tok = ChatTok(PromptFormat(chat="user", system="Answer with a number."))
    assert encode_example(tok, PLAIN) == ("chat", [sys_turn, {"role": "user", "content": "2+2="}])
    assert encode_example(tok, MESSAGES) == ("chat", [sys_turn] + MESSAGES.meta["messages"])
    assert encode_example(tok, OWN_SYSTEM) == ("chat", OWN_SYSTEM.meta["messages"])
    messages = ChatTok(PromptFormat(system="Answer with a number."))     # `messages` mode: templated ones only
    assert encode_example(messages, PLAIN) == ("plain", "2+2=")
    assert encode_example(messages, MESSAGES) == ("chat", [sys_turn] + MESSAGES.meta["messages"])


def test_without_a_template_the_prompt_text_is_sent():
    tok = CharTokenizer("0123456789+=")
    tok.prompt_format = PromptFormat(chat="messages")
    assert encode_example(tok, MESSAGES) == tok.encode("2+2=")


def _cfg(**task):
    cfg = config_mod.Config()
    for k, v in task.items():
        setattr(cfg.task, k, v)
    return cfg


def _task(*examples):
    return Task(name="t", train=list(examples), heldout=[], rewards={}, goal=lambda p, r, a: True, max_new_tokens=2)


def test_the_run_checks_the_format_against_the_tokenizer():
    logs = []
    char = CharTokenizer("0123456789+=")
    with pytest.raises(RunError, match="task.chat = 'user' needs a tokenizer with a chat template; the built-in model's has none"):
        prompt_format(_cfg(chat="user"), _task(PLAIN), char, logs.append)
    with pytest.raises(RunError, match="task.system needs a tokenizer with a chat template"):
        prompt_format(_cfg(system="hi"), _task(PLAIN), char, logs.append)
    assert prompt_format(_cfg(), _task(PLAIN), char, logs.append) == PromptFormat() and logs == []
    # plain prompts past a chat template: said at start, with the option that templates them
    assert prompt_format(_cfg(), _task(PLAIN), ChatTok(), logs.append) == PromptFormat()
    assert len(logs) == 1 and "plain text" in logs[0] and "--task.chat=user" in logs[0]
    logs.clear()
    for cfg, task in ((_cfg(), _task(MESSAGES)), (_cfg(chat="user", system="s"), _task(PLAIN)),
                      (_cfg(chat="off"), _task(PLAIN))):
        assert prompt_format(cfg, task, ChatTok(), logs.append) == PromptFormat(cfg.task.chat, cfg.task.system)
    assert logs == []


def test_a_system_message_with_chat_off_is_a_config_error(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[task]\nchat = "off"\nsystem = "Be brief."\n')
    with pytest.raises(config_mod.ConfigError, match=r"task.system: is set, but task.chat = 'off'.*run.toml"):
        config_mod.load(path)
