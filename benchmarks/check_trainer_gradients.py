"""Does the trainer compute the right gradient on this device? Its FSDP2 path (`train_step`: document
attention, chunked LM-head logprobs, the RL loss) against a plain Hugging Face model with full logits, on
one packed batch of 8 random samples; then 8 AdamW steps of each, side by side.

    python benchmarks/check_trainer_gradients.py MODEL_DIR cuda float32 document
    python benchmarks/check_trainer_gradients.py MODEL_DIR cpu float32 dense

Prints the gradient's relative error and cosine against the reference, the worst parameters, and per step
both losses and the mean logprob of tokens with positive / negative advantage (which must rise / fall).
"""

import sys

import torch
from transformers import AutoModelForCausalLM

from asyncrl.config.schema import TrainerConfig
from asyncrl.trainer.distributed import init_distributed
from asyncrl.trainer.logprobs import compute_logprobs, token_logprobs
from asyncrl.trainer.loss import LossInputs, rl_loss
from asyncrl.trainer.model import clip_grad_norm, make_optimizer, parallelize, setup_model
from asyncrl.trainer.rl import train_step
from asyncrl.transport.rollouts import MicroBatch

model_dir, device, dtype, attention = sys.argv[1:5]
cfg = TrainerConfig(
    model={"name": model_dir, "dtype": dtype}, device=device, optim={"lr": 1e-3}, perf={"attention": attention}
)
world = init_distributed(device, 0, 0)
dev = world.device

g = torch.Generator().manual_seed(0)
ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(dev)
vocab = ref.config.vocab_size
lengths = [int(x) for x in torch.randint(20, 40, (8,), generator=g)]
samples = [torch.randint(3, min(vocab, 120), (n,), generator=g) for n in lengths]
adv_per = torch.randn(len(samples), generator=g)


def ref_logprobs(model, grad):
    out = []
    with torch.set_grad_enabled(grad):
        for s in samples:
            logits = model(input_ids=s[None].to(dev)).logits[0]
            out.append(token_logprobs(logits, s.to(dev))[0])
    return torch.cat(out)


input_ids = torch.cat(samples)
position_ids = torch.cat([torch.arange(n) for n in lengths])
loss_mask = (position_ids >= 5).to(torch.int32)  # "prompt" = first 5 tokens of each sample
advantages = torch.cat([torch.full((n,), float(a)) for n, a in zip(lengths, adv_per)])
inference_logprobs = ref_logprobs(ref, False).detach().cpu()
mb = MicroBatch(
    input_ids=input_ids,
    position_ids=position_ids,
    loss_mask=loss_mask,
    advantages=advantages,
    inference_logprobs=inference_logprobs,
    temperature=torch.ones(len(input_ids)),
    sample_lengths=torch.tensor(lengths),
)
total = int(loss_mask.sum())
pos, neg = (loss_mask.bool() & (advantages > 0)), (loss_mask.bool() & (advantages < 0))

model = setup_model(cfg.model, dev, cfg.perf)
model = parallelize(model, world.world_size, dev, cfg.model.dtype, cfg.perf)
opt = make_optimizer(model, cfg.optim)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)


def ref_step():
    lp = ref_logprobs(ref, True)
    inp = LossInputs(
        lp,
        inference_logprobs.to(dev),
        advantages.to(dev),
        loss_mask.to(dev),
        position_ids.to(dev),
        total,
    )
    loss, _ = rl_loss(inp, cfg.loss)
    loss.backward()
    return float(loss)


def summary(lp):
    lp = lp.cpu()
    return float(lp[pos].mean()), float(lp[neg].mean())


print(f"== gradcheck device={dev} dtype={dtype} attention={attention} tokens={len(input_ids)} loss_tokens={total}")
for step in range(8):
    metrics = train_step(model, [mb], cfg, world)
    ref_loss = ref_step()
    if step == 0:
        names = dict(ref.named_parameters())
        num, den, dot, n1, n2 = 0.0, 0.0, 0.0, 0.0, 0.0
        worst = []
        for name, p in model.named_parameters():
            if p.grad is None:
                print("  no grad:", name)
                continue
            ours = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            theirs = names[name].grad
            diff = (ours.float() - theirs).norm().item()
            worst.append((diff / max(theirs.norm().item(), 1e-12), name))
            num += diff**2
            den += theirs.norm().item() ** 2
            dot += (ours.float() * theirs).sum().item()
            n1 += ours.float().norm().item() ** 2
        worst.sort(reverse=True)
        print(
            f"  grad rel err {num**0.5 / den**0.5:.2e}  cosine {dot / (n1**0.5 * den**0.5):.6f}  "
            f"norm ours {n1**0.5:.4f} ref {den**0.5:.4f}"
        )
        print("  worst params:", ", ".join(f"{n}={e:.1e}" for e, n in worst[:4]))
    gn = clip_grad_norm(model, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        ours_lp = compute_logprobs(model, input_ids.to(dev), position_ids.to(dev))[0]
    ref_lp = ref_logprobs(ref, False)
    print(
        f"  step {step + 1}: loss ours {metrics['loss']:+.5f} ref {ref_loss:+.5f} | grad_norm {gn:.4f} | "
        "mean lp A>0 / A<0: ours %.4f / %.4f  ref %.4f / %.4f" % (*summary(ours_lp), *summary(ref_lp))
    )
