"""Are the native engine's samples drawn from the model's distribution, on this device?

    python benchmarks/check_engine_samples.py MODEL_DIR cuda bfloat16 1 [SAMPLES_PER_PROMPT]   # 1: CUDA graphs

For every sampled token x_t, with p_t the teacher-forced float32 Hugging Face distribution at that
position: E[-log p_t(x_t)] must equal E[H(p_t)] (their z-score is printed), and the probability-integral
transform of x_t must be uniform (mean 0.5, sd 0.2887). Requests are staggered, so samples join a running
batch (continuous batching, slot moves). Also printed: the largest gap between the engine's logprob and
the reference's (bf16 against a float32 reference is not expected to be small).
"""

import sys
import time

import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import InferenceConfig
from asyncrl.inference.engine.engine import Engine, GenerationRequest
from asyncrl.loading import load_tokenizer

model_dir, device, dtype, graphs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
cfg = InferenceConfig(
    model={"name": model_dir, "dtype": dtype}, device=device, cuda_graphs=graphs, seq_len=256, max_batch_size=96
)
engine = Engine(cfg)
tok = load_tokenizer(model_dir)
words = ["hello", "abcdefg", "reverse", "qwertyui", "zyxw", "lmnopqrs", "banana", "kitchen"]
prompts = [
    tok.encode(
        tok.apply_chat_template([{"role": "user", "content": w}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    for w in words
]
samples_per_prompt = int(sys.argv[5]) if len(sys.argv) > 5 else 32
t0 = time.time()
futures = []
for i, p in enumerate(prompts):
    request = GenerationRequest(prompt_ids=p, n=samples_per_prompt, max_tokens=20, seed=1000 * i)
    futures.append((p, engine.generate(request)))
    time.sleep(0.01 * (i % 3))
results = [(p, c) for p, f in futures for c in f.result(timeout=300)]
gen_time = time.time() - t0
engine.stop()

dev = engine.device
ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
nll, ent, pit, mism, first_nll, first_ent, first_pit = [], [], [], [], [], [], []
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for prompt, c in results:
        ids = torch.tensor(prompt + c.token_ids, device=dev)
        logp = torch.log_softmax(ref(input_ids=ids[None]).logits[0].float(), -1)
        for j, x in enumerate(c.token_ids):
            lp = logp[len(prompt) - 1 + j]
            p = lp.exp()
            h = float(-(p * lp).sum())
            below = float(p[:x].sum())
            u = below + float(torch.rand((), generator=g)) * float(p[x])
            nll.append(-float(lp[x]))
            ent.append(h)
            pit.append(u)
            mism.append(abs(float(lp[x]) - c.logprobs[j]))
            if j == 0:
                first_nll.append(nll[-1])
                first_ent.append(h)
                first_pit.append(u)


def z(a, b):
    d = torch.tensor(a) - torch.tensor(b)
    return float(d.mean() / (d.std() / len(d) ** 0.5))


pit_t = torch.tensor(pit)
print(
    f"== samplecheck device={dev} dtype={dtype} graphs={graphs}: {len(nll)} tokens in {gen_time:.1f}s | "
    f"mean nll {sum(nll) / len(nll):.4f} vs mean entropy {sum(ent) / len(ent):.4f} (z {z(nll, ent):+.2f}) | "
    f"first token z {z(first_nll, first_ent):+.2f} PIT mean {sum(first_pit) / len(first_pit):.3f} | "
    f"PIT mean {float(pit_t.mean()):.4f} "
    f"(sd {float(pit_t.std()):.4f}, uniform 0.2887) quartiles "
    f"{[round(float(q), 3) for q in pit_t.quantile(torch.tensor([0.25, 0.5, 0.75]))]} | "
    f"max |engine lp - ref lp| {max(mism):.2e}"
)
