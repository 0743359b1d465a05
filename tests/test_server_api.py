"""The server's API as vLLM's answers it: unsupported and unknown fields, n choices, stop tokens, min_tokens,
logit_bias, include_stop_str_in_output, structured output, /tokenize, /detokenize, /version, X-Request-Id,
CORS, --chat-template, vLLM's metric names and the OpenAPI document. Through the openai client on tiny-llama
(its byte tokenizer: token id = byte + 4), against the offline engine where outputs are compared."""
import json
import logging

import httpx
import openai
import pytest

from servewise import LLM, SamplingParams

from test_server import ENGINE, running_server

pytestmark = pytest.mark.server  # (the engine runs in a thread of the test: no other process)

MODEL = "tiny-llama"


def tok(ch: str) -> int:
    return ord(ch) + 4  # the byte tokenizer's id for an ASCII character


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>>")
    with running_server(engine_process=False, chat_template=str(template), allowed_origins=["http://ui.example"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http():
    with httpx.Client() as c:  # (one client: httpx.post builds a new one, SSL context and all, every call)
        yield c


@pytest.fixture(scope="module")
def offline():
    return LLM(MODEL, **ENGINE)


def greedy(llm, prompt, n, **kw):
    return llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw))[0]


@pytest.mark.parametrize("field, value", [("suffix", "end"), ("best_of", 3), ("use_beam_search", True),
                                          ("prompt_logprobs", 1), ("guided_json", {"type": "object"})])
def test_an_openai_or_vllm_field_the_server_does_not_serve_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
    # the value that changes nothing is accepted (clients send their defaults)
    off = {"suffix": None, "best_of": 1, "use_beam_search": False, "prompt_logprobs": None, "guided_json": None}
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={field: off[field]})
    assert r.usage.completion_tokens >= 1


def test_tools_without_a_forced_choice_are_refused_and_unknown_fields_named_in_a_warning(client, caplog):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools)
    assert e.value.body["param"] == "tool_choice" and "auto" in e.value.body["message"]  # (the default)
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's chat echo
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"echo": True})
    assert e.value.body["param"] == "echo"
    with caplog.at_level(logging.WARNING, logger="servewise"):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={"frobnicate": 1, "zz_top": "x"}, metadata={"k": "v"})
    assert r.choices[0].message.content is not None
    warned = [m.getMessage() for m in caplog.records if "no API defines" in m.getMessage()]
    assert len(warned) == 1 and "frobnicate, zz_top" in warned[0] and "metadata" not in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="servewise"):  # a flood of them: one short line
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={f"f{i:03d}" + "x" * 500: i for i in range(300)})
    warned = [m.getMessage() for m in caplog.records if "no API defines" in m.getMessage()]
    assert len(warned) == 1 and warned[0].endswith("and 280 more") and len(warned[0]) < 2000


def test_n_choices_are_sampled_independently_and_a_seed_reproduces_them(client):
    kw = dict(model=MODEL, prompt="Several", max_tokens=12, temperature=1.0, n=3, seed=7,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3  # three draws, not one copied
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == len(b"Several") + 1
    again = client.completions.create(**kw)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts
    # choice i is the request seeded seed + i (vLLM's derivation): choice 1 alone, with seed 8
    one = client.completions.create(**{**kw, "n": 1, "seed": 8})
    assert one.choices[0].text == texts[1]
    # streamed: every choice's pieces arrive under its index, and each finishes
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == texts
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason == "length") == 3


def test_chat_streams_n_choices(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                                 max_tokens=5, seed=1, stream=True, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_stop_token_ids_end_the_output_and_their_text_is_kept_only_when_asked(client, offline):
    prompt = "Stop tokens"
    free = greedy(offline, prompt, 12)
    stop_id = free.token_ids[4]  # the fifth greedy token: the output ends there
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True})
    first = free.token_ids.index(stop_id)
    want = offline.engine.tokenizer.decode(free.token_ids[:first])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want
    assert r.usage.completion_tokens == first + 1  # the stop token is produced, its text left out
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "ignore_eos": True,
                                              "include_stop_str_in_output": True})
    assert r.choices[0].text == offline.engine.tokenizer.decode(free.token_ids[:first + 1])


def test_include_stop_str_in_output_keeps_the_stop_string(client, offline):
    free = greedy(offline, "Stop strings", 12).text
    stop = free[3:5]
    cut = client.completions.create(model=MODEL, prompt="Stop strings", max_tokens=12, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    kept = client.completions.create(model=MODEL, prompt="Stop strings", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    at = free.index(stop)
    assert cut.choices[0].text == free[:at] and kept.choices[0].text == free[:at + len(stop)]


def test_min_tokens_masks_the_stop_token_and_logit_bias_moves_the_choice(client, offline):
    free = greedy(offline, "Min tokens", 8)
    stop_id = free.token_ids[0]  # the first greedy token, made a stop token: without min_tokens, one token
    r = client.completions.create(model=MODEL, prompt="Min tokens", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "min_tokens": 5, "ignore_eos": True})
    assert r.usage.completion_tokens >= 5
    # the same request offline, with the token masked for the first five steps: the same tokens
    masked = offline.generate("Min tokens", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                           stop_token_ids=[stop_id], min_tokens=5))[0]
    assert r.usage.completion_tokens == len(masked.token_ids) and stop_id not in masked.token_ids[:5]
    r = client.completions.create(model=MODEL, prompt="Min tokens", max_tokens=6, temperature=0,
                                  logit_bias={str(tok("Q")): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == "QQQQQQ"
    for bad in ({"x": 1}, {str(10**6): 1}, {"5": 101}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias=bad)
        assert e.value.body["param"] == "logit_bias"


def test_json_schema_output_parses_and_validates(client):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                           response_format=fmt, seed=seed, temperature=1.0)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # JSON mode: any object; the default max_tokens (the rest of the context) leaves room to close it
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON"}], seed=3,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format"


def test_response_format_without_the_extra_is_a_clear_400(server, client, monkeypatch):
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "xgrammar" else real(name, *a, **k))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "servewise[structured]" in e.value.body["message"]


def test_chat_default_max_tokens_is_the_rest_of_the_context_and_the_template_is_the_given_file(http, server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ignore_eos": True})
    prompt = "[user] hi\n>>"  # the --chat-template file's rendering
    assert r.usage.prompt_tokens == len(prompt.encode()) + 1
    assert r.usage.completion_tokens == ENGINE["max_model_len"] - r.usage.prompt_tokens
    t = http.post(server[0] + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert t["count"] == r.usage.prompt_tokens and t["tokens"][1:] == [b + 4 for b in prompt.encode()]


def test_tokenize_detokenize_version_and_request_ids(http, server):
    url = server[0]
    t = http.post(url + "/tokenize", json={"model": MODEL, "prompt": "héllo"}).json()
    assert t["tokens"] == [1] + [b + 4 for b in "héllo".encode()] and t["count"] == 7
    assert t["max_model_len"] == ENGINE["max_model_len"]
    assert http.post(url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    bad = http.post(url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert http.post(url + "/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    import servewise
    assert http.get(url + "/version").json() == {"version": servewise.__version__}
    r = http.post(url + "/v1/completions", headers={"X-Request-Id": "trace-42"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    r = http.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"] and len(r.headers["x-request-id"]) == 32
    assert http.get(url + "/nowhere", headers={"X-Request-Id": "e1"}).headers["x-request-id"] == "e1"


def test_cors_preflight_and_allow_header_on_405(http, server):
    url = server[0]
    pre = http.options(url + "/v1/completions", headers={"Origin": "http://ui.example",
                                                          "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
    other = http.options(url + "/v1/completions", headers={"Origin": "http://evil.example",
                                                            "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = http.get(url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_openapi_lists_the_error_answers(http, server):
    doc = http.get(server[0] + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        answers = doc["paths"][path]["post"]["responses"]
        assert {"400", "404", "429", "503"} <= set(answers) and "422" not in answers
        assert answers["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "/version" in doc["paths"]


def test_vllm_metric_names_for_its_dashboard(http, server, client):
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True})
    text = http.get(server[0] + "/metrics").text
    label = f'model_name="{MODEL}"'
    # every series vLLM's Grafana dashboard queries, under its name and label
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_prompt_tokens_bucket",
                 "vllm:request_generation_tokens_bucket", "vllm:request_decode_time_seconds_sum",
                 "vllm:request_max_num_generation_tokens_sum"):
        assert any(line.startswith(name + "{") and label in line for line in text.splitlines()), name
    def value(name: str, *labels: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and all(lb in line for lb in labels))

    assert value("vllm:request_success_total", label, 'finished_reason="length"') >= 1
    assert value("vllm:generation_tokens_total", label) >= 3
    assert value("vllm:generation_tokens_total") == value("vllm:request_generation_tokens_sum")
    before = value("vllm:request_max_num_generation_tokens_count"), value("vllm:request_max_num_generation_tokens_sum")
    client.completions.create(model=MODEL, prompt="metrics", n=2, max_tokens=4, extra_body={"ignore_eos": True})
    text = http.get(server[0] + "/metrics").text
    assert value("vllm:request_max_num_generation_tokens_count") == before[0] + 1  # one request of two choices
    assert value("vllm:request_max_num_generation_tokens_sum") == before[1] + 4


@pytest.mark.parametrize("flags, message", [
    (["--chat-template", "no-such-file.jinja"], "neither a file nor a Jinja template"),
    (["--chat-template", "{% for m in messages %}"], "not valid Jinja"),
    (["--allowed-origins", '["http://a", 3]'], "a JSON list of origins"),
    (["--allowed-origins", "[oops"], "not a JSON list"),
])
def test_bad_server_flags_fail_with_one_line_before_an_engine_is_built(flags, message, capsys):
    from servewise.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", MODEL, "--engine-in-thread", *flags])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err and "serving" not in err


def test_the_sampler_masks_stop_tokens_below_min_tokens_and_adds_logit_bias():
    import torch

    from servewise.runners.sampler import sample
    from servewise.runners.torch_runner import SeqState

    logits = torch.zeros(3, 300)
    logits[:, 2], logits[:, 10], logits[:, 20] = 5.0, 4.0, 3.0  # eos, a stop token, the next best
    rows = [SeqState([1], [], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[10])),
            SeqState([1], [7, 7], SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[10])),  # reached
            SeqState([1], [], SamplingParams(temperature=0, logit_bias={30: 6.0}))]
    assert sample(logits, rows, stop_ids=(2,)).tokens == [20, 2, 30]
    # stop tokens that cover the vocabulary leave nothing to sample below min_tokens: the request ends on one
    # (sampling from nothing read past the vocabulary and failed the engine's step)
    for t in (0.0, 1.0):
        every = SeqState([1], [], SamplingParams(temperature=t, min_tokens=3, stop_token_ids=list(range(300))))
        assert sample(torch.randn(1, 300), [every], stop_ids=(2,)).tokens[0] < 300


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "metric": {"type": "boolean"}},
    "required": ["city", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def test_forced_tool_calls_follow_the_functions_schemas(client):
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    messages = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                       seed=0)
    call, = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    jsonschema.validate(json.loads(call.function.arguments), params["weather"])
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice="required",
                                       seed=1)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].message.content is None
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice=named,
                                                 seed=0, stream=True))
    streamed = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name == "weather"
    jsonschema.validate(json.loads(streamed[0].function.arguments), params["weather"])
    for tools, choice, param in (([WEATHER], "auto", "tool_choice"), ([WEATHER], {"type": "function"}, "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": "weather"}, "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([{"type": "function"}], "required", "tools")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice)
        assert e.value.body["param"] == param


def test_new_fields_at_odd_values_get_a_200_or_a_400_and_never_fail_the_engine(server):
    from concurrent.futures import ThreadPoolExecutor

    url, engine = server
    fields = ["n", "stop_token_ids", "min_tokens", "logit_bias", "include_stop_str_in_output", "response_format",
              "tools", "tool_choice"]
    odd = [-1, 2**64, "x", [10**9], {"7": 1e9}, {"type": "json_schema"}, [{"type": "function", "function": None}]]

    def send(field, value):
        r = http.post(url + "/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, field: value,
                                                          "messages": [{"role": "user", "content": "x"}]})
        return field, value, r.status_code, r.json()

    with httpx.Client() as http, ThreadPoolExecutor(8) as pool:  # eight at a time: the engine batches them
        answers = list(pool.map(lambda fv: send(*fv), [(f, v) for f in fields for v in odd]))
    for field, value, status, body in answers:
        assert status == 200 or (status == 400 and body["error"]["message"]), (field, value, body)
    refused = sum(status == 400 for *_, status, _ in answers)
    assert refused >= len(answers) * 3 // 4, refused  # (most are refused; some are valid or mean "off")
    assert engine.alive and engine.error is None


@pytest.mark.parametrize("family", ["byte_level", "sentencepiece"])
def test_grammars_over_a_tokenizer_json_vocabulary(tmp_path, family):
    """A model directory's tokenizer.json (byte-level BPE as GPT-2's, SentencePiece pieces with byte fallback as
    Llama 2's) reaches xgrammar through transformers: sampled under the mask, the output parses and validates."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from servewise.models.tokenizer import HFTokenizer
    from servewise.runners.sampler import sample
    from servewise.runners.torch_runner import SeqState
    from servewise.structured import Grammars

    corpus = ['{"city": "Oslo", "ok": true}', "The weather in Lima is warm.", "café ☕ naïve"] * 20
    if family == "byte_level":
        t = Tokenizer(models.BPE())
        t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<eos>"], show_progress=False)
    else:
        t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"], show_progress=False)
    t.train_from_iterator(corpus, trainer)
    t.save(str(tmp_path / "tokenizer.json"))
    if family == "sentencepiece":  # the 256 byte pieces, as ordinary tokens of the vocabulary
        spec = json.loads((tmp_path / "tokenizer.json").read_text())
        for b in range(256):
            spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"), 0)
    V = tok.tok.get_vocab_size()
    grammars = Grammars(tok, V, [0])
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "ok": {"type": "boolean"}},
              "required": ["city", "ok"], "additionalProperties": False}
    for seed in range(2):
        row = SeqState([1], [], SamplingParams(temperature=1.0, seed=seed, json_schema=json.dumps(schema)))
        row.grammar = grammars.constraint(json.dumps(schema))
        logits = torch.randn(64, V, generator=torch.Generator().manual_seed(seed))
        for step in range(64):
            token = sample(logits[step:step + 1].clone(), [row], (0,)).tokens[0]
            if token == 0:
                break
            row.output_token_ids.append(token)
        assert token == 0, "the grammar ended and only the end of sequence was left"
        jsonschema.validate(json.loads(tok.decode(row.output_token_ids)), schema)
