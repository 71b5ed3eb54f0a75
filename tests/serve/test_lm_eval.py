"""lm-eval's `local-completions` model against `minirun serve`: a small multiple-choice task (a
JSONL written here) runs and scores, and every log-likelihood it reports is the engine's own sum
over the answer's tokens (Engine.logits, not the server) to 1e-4."""
from __future__ import annotations

import json
import math

import pytest
import torch

from minirun import Engine
from minirun.serve.server import make_server
from test_serve import ThreadServer

DOCS = [{"question": f"Item {i}: which word comes next?", "choices": ["apple", "river stone", "blue"], "answer": i % 3}
        for i in range(6)]
TASK = """task: minirun_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_lm_eval_local_completions_scores_with_the_engines_logprobs(tiny_model_dir, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager
    d = tiny_model_dir("gqa-untied")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=tmp_path / "docs.jsonl"))
    eng = Engine.load(d, device="cpu", ctx=512)
    srv = ThreadServer(make_server(eng, "tiny", log_level="warning"))
    asked = []
    submit = srv.server.worker.submit
    srv.server.worker.submit = lambda job: (asked.append(list(job.ids)), submit(job))[1]
    try:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model=tiny,base_url={srv.url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={d},tokenized_requests=True,num_concurrent=1,max_retries=1",
            tasks=["minirun_tiny"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    finally:
        srv.close()
    acc = out["results"]["minirun_tiny"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and len(out["samples"]["minirun_tiny"]) == len(DOCS)
    reported = [r[0][0] for s in out["samples"]["minirun_tiny"] for r in s["resps"]]
    assert len(reported) == 3 * len(DOCS) and len(asked) >= len(reported)
    ref = Engine.load(d, device="cpu", ctx=512)
    # each reported log-likelihood: the sum over the last tokens (the answer's) of a prompt sent
    suffix_sums = []
    for ids in asked:
        lp = torch.log_softmax(ref.logits(ids).float(), -1)
        per_token = [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
        suffix_sums.append([sum(per_token[-k:]) for k in range(1, len(per_token) + 1)])
    for value in reported:
        assert math.isfinite(value) and value < 0
        assert any(abs(value - s) <= 1e-4 for sums in suffix_sums for s in sums), value
