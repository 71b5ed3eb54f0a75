"""`minirun serve --parallel 4`: four streamed clients at once, one of them leaving early; the
others get what they get alone, and the health check counts the slots."""
from __future__ import annotations

import json
import threading
import urllib.request

from minirun import Engine
from minirun.serve.server import make_server
from test_serve import ThreadServer

PROMPTS = ["Alpha beta", "Gamma delta epsilon", "Zeta", "Eta theta iota kappa"]


def test_four_streamed_clients_one_leaving(tiny_model_dir, monkeypatch):
    d = tiny_model_dir("gqa-untied")
    eng = Engine.load(d, device="cpu", ctx=1024, parallel=4)
    sizes = []
    step_batch = Engine.step_batch
    monkeypatch.setattr(Engine, "step_batch", staticmethod(lambda engines, toks: (sizes.append(len(engines)),
                                                                                   step_batch(engines, toks))[1]))
    srv = ThreadServer(make_server(eng, "tiny", log_level="warning"))
    try:
        health = json.loads(urllib.request.urlopen(srv.url + "/health", timeout=10).read())
        assert health["slots"] == 4 and health["active"] == 0
        out, start = {}, threading.Barrier(4)

        def client(i):
            c = srv.client()
            start.wait()
            stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}],
                                               max_tokens=400 if i == 2 else 40, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
            text = ""
            for chunk in stream:
                text += "".join(ch.delta.content or "" for ch in chunk.choices)
                if i == 2 and len(text) > 10:      # this client leaves
                    stream.close()
                    break
            out[i] = text
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert max(sizes) == 4                       # the four answered in one forward
        alone = Engine.load(d, device="cpu", ctx=1024)
        for i in (0, 1, 3):
            want = alone.chat([{"role": "user", "content": PROMPTS[i]}], max_new_tokens=40, ignore_eos=True)
            assert out[i] == want.text, i
            alone.reset()
    finally:
        srv.close()
    assert not srv.server.worker.busy
