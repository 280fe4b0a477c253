"""task.chat / task.system: how a task's prompts reach the tokenizer (rlvr.tokenizer.encode_example,
rlvr.build.prompt_format)."""

import pytest

from rlvr import config as config_mod
from rlvr.build import prompt_format
from rlvr.setup_types import RunError
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


def _hf_tokenizer(adds_bos: bool):
    """A byte-level-free BPE tokenizer (printable ASCII one token each) with a ChatML template; BOS
    added to plain text by its post-processor when `adds_bos`."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    from rlvr.models.hf_tokenizer import HFTokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = specials + [chr(c) for c in range(32, 127)] + ["\n"]
    bk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    bk.add_special_tokens(specials)
    bk.decoder = decoders.Fuse()
    if adds_bos:
        bk.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>")
    tok.chat_template = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                         "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                         "{% endif %}")
    return HFTokenizer(tok)


@pytest.mark.parametrize("adds_bos", [False, True])
@pytest.mark.parametrize("fmt", [PromptFormat(), PromptFormat(chat="user", system="Be brief."), PromptFormat(chat="off")])
def test_batched_encoding_gives_the_ids_of_one_call_a_prompt(adds_bos, fmt, monkeypatch):
    """rlvr.tokenizer.encode_examples (the run's longest-prompt measure and each sampling call) gives
    what encode_example gives example by example: chat turns, a system turn, plain text with and
    without BOS, mixed in one list, across batches (ENCODE_BATCH = 3 over 9 prompts)."""
    from rlvr.models.hf_tokenizer import HFTokenizer
    from rlvr.tasks.arith import arith_task
    from rlvr.tokenizer import encode_examples

    tok = _hf_tokenizer(adds_bos)
    tok.prompt_format = fmt
    assert tok.adds_bos is adds_bos
    examples = list(arith_task(ops="+", digits=1, heldout=4).heldout) + [PLAIN, MESSAGES, OWN_SYSTEM] + [
        Example(prompt="  spaces  and\nlines ", answer="")]
    monkeypatch.setattr(HFTokenizer, "ENCODE_BATCH", 3)
    one = [encode_example(tok, ex) for ex in examples]
    assert encode_examples(tok, examples) == one
    assert len({tuple(ids) for ids in one[:4]}) == 4 and (fmt.chat == "off") is (2 not in one[0])  # <|im_end|>: templated
    assert (one[4][0] == tok.bos_id) is (adds_bos or fmt.chat == "user")   # PLAIN: text, or a templated turn
    char = CharTokenizer("0123456789+=")                                   # no batched call: one by one
    assert encode_examples(char, [PLAIN]) == [encode_example(char, PLAIN)] == [char.encode_prompt("2+2=")]
