"""What a run samples from and how it is scored: JSONL datasets and their held-out
split, verifiable rewards, the arithmetic dataset, model folders checked at the
door, and the model tokenizer's chat template. No processes here."""

import fcntl
import json
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import transformers

from llamarl_core.models.checkpoint import ModelSource, check_generator_config, context_length, save_model_folder
from llamarl_core.pipeline import TrainConfig
from llamarl_core.pipeline.arithmetic import arithmetic_problems
from llamarl_core.pipeline.data import ModelTokenizer, Problem, RunData, chat_end_of_turn, read_dataset
from llamarl_core.pipeline.rewards import (
    RuleReward,
    answers_match,
    check_reward_model,
    extract_answer,
    format_reward,
    math_reward,
    parse_number,
)
from llamarl_core.pipeline.task import CharTokenizer

# ----------------------------------------------------------------------------- rewards


@pytest.mark.parametrize("text, answer", [
    ("so the total is 42.", "42"),
    ("3 + 4 = 7, then 7 * 2 = 14", "14"),
    ("The answer is \\boxed{1,000}", "1,000"),  # compared by value later
    ("\\boxed{\\frac{1}{2}} hmm", "\\frac{1}{2}"),  # not a number: compared as text
    ("first \\boxed{3} then \\boxed{5} and 9", "5"),  # the last box wins over later numbers
    ("-12 degrees", "-12"),
    ("half: 0.5", "0.5"),
    ("it is 3/4", "3/4"),
])
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_numbers_compare_by_value():
    assert parse_number("1,000") == 1000 and parse_number("$12.50") == Fraction(25, 2)
    assert parse_number("abc") is None and parse_number("1/0") is None
    assert answers_match("0.75", "3/4") and answers_match("1000.0", "1,000") and answers_match("42.", "42")
    assert not answers_match("41", "42") and not answers_match(None, "42")
    assert answers_match("x + 1", " x + 1 ")  # not numbers: text, whitespace ignored


def test_math_and_format_rewards_in_batches():
    completions = ["5 + 3 = 8", "I think \\boxed{8}", "\\boxed{9}", "no idea"]
    answers = ["8"] * 4
    assert math_reward([None] * 4, completions, answers) == [1.0, 1.0, 0.0, 0.0]
    assert format_reward([None] * 4, completions, answers) == [0.0, 1.0, 1.0, 0.0]
    reward = RuleReward("math + 0.1*format")
    assert reward.needs_answer
    problems = [Problem("q", "8")] * 4
    assert reward(problems, completions) == pytest.approx([1.0, 1.1, 0.1, 0.0])


def test_reward_spec_errors_name_the_culprit():
    with pytest.raises(ValueError, match="unknown reward 'maths'"):
        RuleReward("maths")
    with pytest.raises(ValueError, match="'x' is not a weight"):
        RuleReward("x*math")
    with pytest.raises(ValueError, match="cannot load it"):
        RuleReward("no_such_module:fn")
    user = RuleReward("pipeline_tasks:length_reward")  # a user's batched function, by module:attribute
    assert not user.needs_answer
    assert user([Problem("q")] * 2, ["ab", "abcd"]) == [2.0, 4.0]


def test_rewards_in_trls_signature_get_the_answers_as_trl_passes_them():
    """fn(prompts, completions, answer, **kwargs) and fn(prompts, completions,
    **kwargs): called with keywords, the answers as `answer=`."""
    answer = RuleReward("pipeline_tasks:trl_answer_reward + 2*pipeline_tasks:trl_kwargs_reward")
    problems = [Problem("q", "8"), Problem("q", "9"), Problem("q")]
    assert answer(problems, ["8", "8", "ab"]) == [1.0 + 2 * 1, 0.0 + 2 * 1, 0.0 + 2 * 2.5]
    # Never the answers in a positional third parameter of another name: a keyword it is not given.
    with pytest.raises(TypeError, match="completion_ids"):
        RuleReward("pipeline_tasks:trl_ids_reward")(problems, ["8", "8", "ab"])


def test_a_list_of_rewards_with_weights_is_their_weighted_sum():
    """TrainConfig(reward=[fn, (w, fn2), "format"]): the functions imported by name
    in the executors, each weighted, summed; what cannot reach them, or is not a
    weight, refused naming the list's index."""
    from pipeline_tasks import trl_answer_reward, trl_kwargs_reward

    config = TrainConfig(reward=[trl_answer_reward, (2, trl_kwargs_reward), (1e20, "format")])
    assert config.run.reward == ("1.0*pipeline_tasks:trl_answer_reward+2.0*pipeline_tasks:trl_kwargs_reward"
                             "+1e20*format")
    reward = RuleReward(config.run.reward)
    problems = [Problem("q", "8"), Problem("q", "9")]
    assert reward(problems, ["8", "\\boxed{9}"]) == [1.0 + 2 * 1, 0.0 + 2 * 9 + 1e20]  # answer, length, format
    with pytest.raises(ValueError, match=r"reward\[1\]: .*lambda"):
        TrainConfig(reward=[trl_answer_reward, (0.5, lambda prompts, completions, **kw: [0.0] * len(completions))])
    with pytest.raises(ValueError, match=r"reward\[0\]: the weight '2' is not a finite real number"):
        TrainConfig(reward=[("2", trl_answer_reward)])
    with pytest.raises(ValueError, match=r"reward\[1\]: the weight nan"):
        TrainConfig(reward=["math", (float("nan"), "format")])
    with pytest.raises(ValueError, match=r"reward\[0\]: 3 is not a reward"):
        TrainConfig(reward=[3])
    with pytest.raises(ValueError, match="an empty list"):
        TrainConfig(reward=[])


# ----------------------------------------------------------------------------- datasets


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("row, match", [
    ("{not json", "line 2: not JSON"),
    ([1, 2], "line 2: expected a JSON object"),
    ({"answer": "3"}, "line 2: needs a non-empty \"prompt\""),
    ({"prompt": "   ", "answer": "3"}, "line 2: needs a non-empty"),
    ({"messages": [{"role": "user"}], "answer": "3"}, "line 2: needs a non-empty"),
    ({"prompt": "1+2?"}, "line 2: no \"answer\""),
    ({"prompt": "1+2?", "answer": " "}, "line 2: no \"answer\""),
])
def test_bad_dataset_lines_are_named(tmp_path, row, match):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1?", "answer": "2"}, row])
    with pytest.raises(ValueError, match=match):
        read_dataset(path, need_answer=True)


def test_dataset_without_answers_for_a_reward_model_and_empty_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}, "", {"prompt": "x"}])
    assert read_dataset(path, need_answer=False) == [Problem([{"role": "user", "content": "hi"}], line=1),
                                                     Problem("x", line=3)]  # file lines, blank ones counted
    with pytest.raises(ValueError, match="no lines"):
        read_dataset(write_jsonl(tmp_path / "e.jsonl", []), need_answer=False)
    with pytest.raises(ValueError, match="No such file"):
        read_dataset(tmp_path / "missing.jsonl", need_answer=False)


def test_arithmetic_dataset_answers_are_exact():
    rows = arithmetic_problems(300, seed=4)
    assert len(rows) == 300 and rows == arithmetic_problems(300, seed=4)
    for row in rows:
        answer = int(row["answer"])
        assert answer >= 0 and row["prompt"].endswith("Give the final answer as a number.")
    bare = [r for r in rows if r["prompt"].startswith("What is ")]
    assert len(bare) == 100
    for r in bare:  # the bare ones recomputed from their text
        a, op, b = r["prompt"][len("What is "):].split("?")[0].split()
        assert int(r["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))


# ----------------------------------------------------------------------------- model folders


def tiny_model(family=transformers.LlamaConfig, **overrides):
    """(model, tokenizer): a random 1-layer causal LM of `family` (a transformers
    config class; Llama by default) and the character tokenizer of the digits,
    letters and punctuation (ids as CharTokenizer's), in memory."""
    chars = CharTokenizer("0123456789abcdefghijklmnopqrstuvwxyz +-*/=?.,")
    config = family(**{**dict(vocab_size=chars.vocab_size, hidden_size=32, intermediate_size=64,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0),
                       **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), chars.to_transformers()


def tiny_model_folder(tmp_path, name="tiny", family=transformers.LlamaConfig, **overrides):
    """tiny_model's model and tokenizer as a real model folder."""
    return save_model_folder(*tiny_model(family, **overrides), tmp_path / name)


def test_a_run_of_python_objects_reads_them_from_its_run_folder(tmp_path):
    """Controller(config, out, model=, tokenizer=, dataset=) with an in-memory
    model, its tokenizer and a datasets.Dataset: written under out/inputs/ (a model
    folder, JSONL) before anything starts, the config (and config.json) naming
    them; a 2-step sync run trains on them and a resume reads them back."""
    datasets = pytest.importorskip("datasets")
    from llamarl_core.pipeline import Controller

    model, tokenizer = tiny_model()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(3)]
    config = TrainConfig(mode="sync", steps=2, prompts_per_step=2, samples_per_prompt=2, max_new_tokens=4,
                         eval_size=2, reward="math", checkpoint_every=2, timeout_s=120)
    out = tmp_path / "run"
    controller = Controller(config, out, model=model, tokenizer=tokenizer, dataset=datasets.Dataset.from_list(rows))
    assert controller.config.run.model == str(out / "inputs" / "model") and config.run.model is None  # the caller's kept
    written = ModelSource(controller.config.run.model)
    assert written.config().hidden_size == 32 and (out / "inputs" / "model" / "model.safetensors").exists()
    assert [json.loads(line) for line in (out / "inputs" / "dataset.jsonl").read_text().splitlines()] == rows
    summary = controller.run()
    assert summary["steps"] == 2
    saved = TrainConfig.load(out / "config.json")
    assert (saved.run.model, saved.run.dataset) == (controller.config.run.model, controller.config.run.dataset)
    assert Controller(saved.replace(steps=3), out, resume=True).run()["steps"] == 3


def test_python_inputs_are_refused_naming_the_argument_before_anything_stays(tmp_path):
    from llamarl_core.pipeline import Controller, RunFolderError
    from llamarl_core.pipeline.run_folder import EXECUTORS_LOCK, LOCK, executor_hold, executor_release

    model, tokenizer = tiny_model()
    rows = [{"prompt": "1+1=", "answer": "2"}] * 4
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="model= needs tokenizer= too"):
        Controller(TrainConfig(), out, model=model)
    with pytest.raises(ValueError, match=r"model= and TrainConfig.run.model \('m'\) both"):
        Controller(TrainConfig(model="m"), out, model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="dataset= row 1: a str, not a dict"):
        Controller(TrainConfig(), out, dataset=[rows[0], "2+2="])
    with pytest.raises(ValueError, match="dataset= row 0: not JSON values"):
        Controller(TrainConfig(), out, dataset=[{"prompt": "x", "answer": float("nan")}])
    with pytest.raises(ValueError, match="tokenizer= must be a transformers tokenizer"):
        Controller(TrainConfig(), out, model=model, tokenizer=object())
    # Written, then refused by the checks (a line without its answer for math): removed again.
    with pytest.raises(ValueError, match=r"line 2: .*answer"):
        Controller(TrainConfig(reward="math"), out, model=model, tokenizer=tokenizer,
                   dataset=[rows[0], {"prompt": "2+2="}, *rows])
    assert not out.exists()
    with pytest.raises(ValueError, match="a resumed run reads its inputs from its run folder"):
        Controller(TrainConfig(), out, resume=True, model=model, tokenizer=tokenizer)
    # A folder another controller runs in (it holds the folder's flock from before it
    # writes config.json): refused, its inputs not written over; free again, written.
    out.mkdir()
    (out / "inputs").mkdir()
    (out / "inputs" / "dataset.jsonl").write_text("theirs\n")
    holder = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunFolderError, match=f"{out} is in use by another run"):
            Controller(TrainConfig(reward="math", max_new_tokens=4), out, model=model, tokenizer=tokenizer, dataset=rows)
        assert (out / "inputs" / "dataset.jsonl").read_text() == "theirs\n"
    finally:
        os.close(holder)
    # A controller given inputs holds the folder from then until its run() ends: a second
    # one is refused, the first's inputs kept; once the first is gone, the folder is free.
    first = Controller(TrainConfig(reward="math", max_new_tokens=4), out, model=model, tokenizer=tokenizer,
                       dataset=rows)
    with pytest.raises(RunFolderError, match=f"{out} is in use by another run"):
        Controller(TrainConfig(reward="math", max_new_tokens=4), out, model=model, tokenizer=tokenizer,
                   dataset=rows[:1])
    assert [json.loads(line) for line in Path(first.config.run.dataset).read_text().splitlines()] == rows
    # An executor of the first still holds the folder after its controller is gone (killed outright,
    # say): refused, naming them; once it has ended (its flock dropped), the folder is free.
    executor = executor_hold(out)
    assert executor is not None
    try:
        del first
        with pytest.raises(RunFolderError, match=f"{out} is in use by executors of an earlier run "
                                                 fr"\(processes {os.getpid()} hold "):
            Controller(TrainConfig(reward="math", max_new_tokens=4), out, model=model, tokenizer=tokenizer,
                       dataset=rows)
    finally:
        executor_release(executor)
    taking = os.open(out / EXECUTORS_LOCK, os.O_RDWR)  # a controller checking for them: one starting now leaves
    try:
        fcntl.flock(taking, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SystemExit, match="another controller is taking the run folder"):
            executor_hold(out)
    finally:
        os.close(taking)
    Controller(TrainConfig(reward="math", max_new_tokens=4), out, model=model, tokenizer=tokenizer, dataset=rows)


def test_model_folder_round_trip_and_checks(tmp_path):
    folder = tiny_model_folder(tmp_path)
    source = ModelSource(folder)
    model = source.load_model()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert context_length(source.config()) == 64
    with pytest.raises(ValueError, match="no such file or folder"):
        ModelSource(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        ModelSource(tmp_path / "empty")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((folder / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no \\*.safetensors weights \\(found pytorch_model.bin: pickle"):
        ModelSource(pickled)
    (tmp_path / "weights.txt").write_text("")
    with pytest.raises(ValueError, match="must be a .gguf model"):
        ModelSource(tmp_path / "weights.txt")
    vit = tmp_path / "vit"
    vit.mkdir()
    transformers.ViTConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2).save_pretrained(vit)
    (vit / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'vit' .* is not a causal language model"):
        ModelSource(vit).config()
    # Any causal LM is a model for the trainer and vLLM; the built-in generator takes the Llama family only.
    config = ModelSource(tiny_model_folder(tmp_path, "qwen3", transformers.Qwen3Config, head_dim=8)).config()
    check_generator_config(config, "vllm", "--model q")
    with pytest.raises(ValueError, match="--model q: model_type 'qwen3' \\(Qwen3ForCausalLM\\): the built-in "
                                         "generator runs the Llama family .* only; run this model with generator='vllm'"):
        check_generator_config(config, "llama", "--model q")
    yarn = tiny_model_folder(tmp_path, "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        check_generator_config(ModelSource(yarn).config(), "llama", "--model yarn")


def test_reward_model_folder_checks(tmp_path):
    folder = tmp_path / "rm"
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_labels=2)
    transformers.LlamaForSequenceClassification(config).save_pretrained(folder)
    with pytest.raises(ValueError, match="one output \\(num_labels 1\\), this one has 2"):
        check_reward_model(folder)
    with pytest.raises(ValueError, match="holds no ...ForSequenceClassification"):
        check_reward_model(tiny_model_folder(tmp_path))


def test_chat_template_and_plain_prompts():
    tokenizer = CharTokenizer("abu:=").to_transformers()
    plain = ModelTokenizer(tokenizer, chat_template=True)  # no template: plain text
    assert not plain.use_chat and plain.encode("ab=") == [1, 3, 4, 7]
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        plain.encode([{"role": "user", "content": "ab="}])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{% endfor %}" \
                              "{% if add_generation_prompt %}a:{% endif %}"
    chat = ModelTokenizer(tokenizer, chat_template=True)
    assert chat.use_chat
    assert chat.decode(chat.encode("ab")) == "u:aba:"  # the user turn, then the assistant's
    assert chat.encode("ab") == chat.encode([{"role": "user", "content": "ab"}])
    assert not ModelTokenizer(tokenizer, chat_template=False).use_chat
    assert chat.decode([3, 4, 2, 5]) == "ab"  # up to eos


SMOLLM2 = Path(os.environ.get("LLAMARL_SMOLLM2", Path(__file__).parents[1] / "models" / "SmolLM2-135M-Instruct"))


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                    reason=f"no SmolLM2-135M-Instruct in {SMOLLM2} (scripts/fetch-smollm2.sh fetches it)")
def test_completions_stop_at_the_end_of_the_chat_turn_too(tmp_path):
    smol = transformers.AutoTokenizer.from_pretrained(SMOLLM2)
    im_end, endoftext = smol.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # SmolLM2-Instruct's eos is <|im_end|>, the token its template ends turns with.
    assert smol.eos_token_id == im_end and chat_end_of_turn(smol) == im_end
    assert ModelTokenizer(smol, chat_template=True).stop_token_ids == (im_end,)
    # The same tokenizer with eos <|endoftext|>, as Qwen2.5 base ships it: its turns still end with <|im_end|>.
    smol.save_pretrained(tmp_path / "tok")
    base = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok", eos_token="<|endoftext|>")
    assert base.eos_token_id == endoftext and chat_end_of_turn(base) == im_end
    chat = ModelTokenizer(base, chat_template=True)
    assert chat.stop_token_ids == (endoftext, im_end)
    made_up_turn = base("The answer is 4.<|im_end|>\n<|im_start|>user\nAnd 5+7? 12", add_special_tokens=False)
    assert chat.decode(made_up_turn["input_ids"]) == "The answer is 4."
    assert ModelTokenizer(base, chat_template=False).stop_token_ids == (endoftext,)  # no template, no turns
    # A generation config's eos id(s) join them (an int or a list), each once.
    assert ModelTokenizer(base, chat_template=False, generation_eos=im_end).stop_token_ids == (endoftext, im_end)
    assert ModelTokenizer(base, chat_template=True, generation_eos=[endoftext, 7]).stop_token_ids == \
        (endoftext, 7, im_end)


def test_the_model_folders_generation_config_adds_stop_ids(tmp_path):
    folder = tiny_model_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert RunData(TrainConfig(model=str(folder))).tokenizer.stop_token_ids == (2, 7)
    (folder / "generation_config.json").unlink()
    assert RunData(TrainConfig(model=str(folder))).tokenizer.stop_token_ids == (2,)


def test_dataset_order_and_held_out_split(tmp_path):
    folder = tiny_model_folder(tmp_path)
    rows = arithmetic_problems(20, seed=1)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = RunData(TrainConfig(model=str(folder), dataset=str(path), eval_every=5, eval_size=4, seed=3))
    assert data.train_size == 16 and [data.eval_problem(i).answer for i in range(4)] == [r["answer"] for r in rows[16:]]
    first_pass = [data.problem(i) for i in range(16)]
    assert sorted(p.prompt for p in first_pass) == sorted(r["prompt"] for r in rows[:16])  # every line once a pass
    assert [data.problem(16 + i) for i in range(16)] != first_pass  # a fresh order each pass
    assert data.problem(5) == RunData(TrainConfig(model=str(folder), dataset=str(path), eval_every=5, eval_size=4,
                                                  seed=3)).problem(5)  # any process gets the same
    with pytest.raises(ValueError, match="20 lines leave none to train on"):
        RunData(TrainConfig(model=str(folder), dataset=str(path), eval_every=5, eval_size=20))
    short = {"prompt": "1+1?", "answer": "2"}
    long = write_jsonl(tmp_path / "long.jsonl", [short] * 3 + [{"prompt": "1+" * 30 + "1?", "answer": "31"}])
    with pytest.raises(ValueError, match="line 4 of .*long.jsonl: 63 prompt tokens \\+ max_new_tokens 8 exceed the "
                                         "model's context of 64"):
        RunData(TrainConfig(model=str(folder), dataset=str(long), max_new_tokens=8)).check_prompts_fit()


def test_tokenizer_larger_than_the_model_is_refused(tmp_path):
    folder = tiny_model_folder(tmp_path, vocab_size=20)
    with pytest.raises(ValueError, match="its tokenizer has 48 tokens, more than the model's vocab_size 20"):
        RunData(TrainConfig(model=str(folder)))
