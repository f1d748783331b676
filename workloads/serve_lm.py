"""An inference server that knows nothing of pos: a causal language model loaded with
transformers in bf16 from safetensors onto the GPU, warmed up, then answering requests dropped
as files with greedy decoding (issue 36's server).

  python workloads/serve_lm.py MODEL_DIR REQUESTS_DIR [--warmup 2]

A request is a file `ID.req` in REQUESTS_DIR holding {"tokens": [...], "new": N}. A server
claims it by renaming it to `ID.req.TAG` (so that several copies of one server share one
folder, each request answered once) and writes `ID.TAG.ans` atomically: {"tokens": the N new
token ids, "t_claimed" and "t_done": the server's clock (time.time()) when it had claimed the
request and when the answer was ready, "tag"}. TAG
is the server's PID as /proc names it, read at each claim, so a restored or cloned server
tags its answers with its own. A token, not text: the bench's weights are random and there is
no tokenizer to ship.

Once warm, the server writes REQUESTS_DIR/ready-PID: {"pid", and its clock at each stage of
its start: "t_start" (the interpreter's first line here), "t_imported", "t_loaded", "t_warm"}.
"""

import argparse
import json
import os
import time

T_START = time.time()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

POLL_S = 0.002


def tag() -> str:
    """This process's PID as /proc names it: after a restore into new namespaces, or beside
    copies of itself, the one that tells the copies apart."""
    try:
        return os.readlink("/proc/self")
    except OSError:
        return str(os.getpid())


def write_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.rename(tmp, path)


@torch.no_grad()
def answer(model, tokens: list[int], new: int) -> list[int]:
    ids = torch.tensor([tokens], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(tokens):].tolist()      # .tolist() waits for the GPU


def serve(model, folder: str) -> None:
    while True:
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".req"):
                continue
            me = tag()
            claimed = os.path.join(folder, f"{name}.{me}")
            try:
                os.rename(os.path.join(folder, name), claimed)
            except FileNotFoundError:
                continue           # another copy took it
            t_claimed = time.time()
            with open(claimed) as f:
                req = json.load(f)
            toks = answer(model, req["tokens"], int(req.get("new", 1)))
            write_atomic(os.path.join(folder, f"{name[:-4]}.{me}.ans"),
                         {"tokens": toks, "t_claimed": t_claimed, "t_done": time.time(),
                          "tag": me})
        time.sleep(POLL_S)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    t_imported = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16,
                                                 device_map="cuda")
    model.eval()
    torch.cuda.synchronize()
    t_loaded = time.time()
    for _ in range(a.warmup):
        answer(model, list(range(1, 33)), 8)
    t_warm = time.time()
    write_atomic(os.path.join(a.requests, f"ready-{os.getpid()}"),
                 {"pid": os.getpid(), "t_start": T_START, "t_imported": t_imported,
                  "t_loaded": t_loaded, "t_warm": t_warm})
    serve(model, a.requests)


if __name__ == "__main__":
    main()
