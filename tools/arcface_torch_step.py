"""arcface_torch's training step: the reference side of `faceshard-bench --mode step`.

Times one whole step of insightface's arcface_torch (recognition/arcface_torch/train_v2.py) on
the CPU with the gloo backend (--device cpu, fp32) or on GPUs with NCCL (--device cuda, one
GPU per rank, fp16 as arcface_torch's configs train: autocast inside the backbone, the
embedding layer in fp32, GradScaler(growth_interval=100), loss.item() every step): the
backbone wrapped in DistributedDataParallel exactly as
train_v2.py wraps it (broadcast_buffers=False, bucket_cap_mb=16, find_unused_parameters=True,
fp16_compress_hook, _set_static_graph), PartialFC_V2 with CombinedMarginLoss(64, 1.0, 0.5, 0.0)
(ArcFace), SGD(lr 0.1, momentum 0.9, weight_decay 5e-4) over [backbone, partial fc], gradient
clipping of the backbone to norm 5 (after unscaling, under fp16), and a per-step LR
scheduler. The backbones (`r18`, `r50`, `r100` = IResNet-18/50/100 from backbones/iresnet.py,
`mbf` = MobileFaceNet from backbones/mobilefacenet.py) and the classifier (partial_fc_v2.py,
losses.py) follow arcface_torch's definitions layer for layer, with the same initialisation.

Input is random: a few batches of N(0, 1) images [B, 3, 112, 112] and labels uniform in
[0, classes) are made per rank before timing and used in turn, so no data loading is timed.
After --warmup steps, --windows windows of --steps steps are timed, each starting after a
barrier; a window's rate is steps * B * world_size / seconds, and the reported rate is the
median window (the upper one for an even count, as faceshard-bench takes it), measured on
rank 0. Thread counts are left as launched (torchrun sets OMP_NUM_THREADS=1 when
--nproc_per_node > 1). On a GPU the phases are timed with CUDA events and the peak memory is
the caching allocator's (torch.cuda.max_memory_allocated).

Run (from the repository root):
  .venv/bin/torchrun --nproc_per_node 1 --master_port 29611 tools/arcface_torch_step.py \
      --network mbf --batch 32 --classes 100000 --sample-rate 1.0 --steps 4 --windows 3 --warmup 2
  .venv/bin/torchrun --nproc_per_node 2 --master_port 29611 tools/arcface_torch_step.py \
      --network r18 --batch 32 --classes 100000 --sample-rate 0.1 --json step.json
  python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29611 tools/arcface_torch_step.py \
      --device cuda --network r50 --batch 256 --classes 1000000 --sample-rate 0.1
and compare with
  build/bin/faceshard-bench --mode step --network mbf --batch 32 --classes 100000 ...

--check runs one step and compares, instead of timing, the PartialFC_V2 loss with a plain
reference computed on every rank from everything gathered (all embeddings, labels, weight
shards and sampled classes): ArcFace-margin cross-entropy (F.cross_entropy) over normalised
embeddings and weights; it also compares the classifier's weight gradient and the backbone
output's gradient (PartialFC_V2 scales it by the world size) with the reference's.

--classifier-only times PartialFC_V2 alone, the reference side of `faceshard-bench --mode
classifier`: random embeddings [batch, 512] per rank (leaves with requires_grad, a few
batches made before timing and used in turn, labels uniform over all classes), its forward,
backward and train_v2's SGD (lr 0.1, momentum 0.9, weight decay 5e-4) over its weight, then
zero_grad and loss.item() as train_v2 does every step. --precision fp16 (the default on
cuda) is train_v2's cfg.fp16 as the classifier sees it: the loss scaled by GradScaler
(growth_interval=100), unscaled before the step; the partial fc itself computes in fp32,
as train_v2 builds it with fp16=False (--pfc-fp16 builds it with fp16=True: its normalise and
GEMM under fp16 autocast, as partial_fc_v2.py does then). --classes-per-shard and
--sample-rate take comma-separated lists and one process measures every cell (classes per
shard x rate, the weight drawn on the device), freeing each cell's memory before the next;
a cell that runs out of GPU memory is reported as not run, and with --time-limit-s no cell
starts that would end past that many seconds from the process's start (guessed from the
cell before it, scaled by the classes). The JSON (rewritten after each cell) is
{"mode": "classifier", "device", "world_size", "batch_per_rank", "dim": 512, "runs": [{
"classes_per_shard", "sample_rate", "step_ms" (the median window's ms per step),
"peak_memory_mb" (GPU: the allocator's peak from the module's creation on; null on the
CPU), ...}]}; a cell not run has "not_run" (why) and null figures. --dump DIR saves each
cell's first two steps (weight before, embeddings, labels, sampled classes, loss, weight
after) for a test to recompute (tests/e2e/arcface_torch_classifier.py). One rank runs
without torchrun too (plain python sets up its rendezvous):
  .venv/bin/torchrun --nproc_per_node 1 --master_port 29611 tools/arcface_torch_step.py --classifier-only \
      --classes-per-shard 100000,1000000 --sample-rate 1.0,0.1 --batch 128 --json arcface_classifier.json
"""

import time

_T0 = time.monotonic()  # --time-limit-s counts from here, before torch's import

import argparse
import gc
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook


# ---------------------------------------------------------------- backbones/iresnet.py
def conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=1e-05)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=1e-05)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=1e-05)
        self.downsample = downsample

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        out += self.downsample(x) if self.downsample is not None else x
        return out


class IResNet(nn.Module):
    def __init__(self, layers, dropout=0.0, num_features=512, fp16=False):
        super().__init__()
        self.fp16 = fp16
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64, eps=1e-05)
        self.prelu = nn.PReLU(64)
        self.layer1 = self._make_layer(64, layers[0], 2)
        self.layer2 = self._make_layer(128, layers[1], 2)
        self.layer3 = self._make_layer(256, layers[2], 2)
        self.layer4 = self._make_layer(512, layers[3], 2)
        self.bn2 = nn.BatchNorm2d(512, eps=1e-05)
        self.dropout = nn.Dropout(p=dropout, inplace=True)
        self.fc = nn.Linear(512 * 7 * 7, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-05)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0, 0.1)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes, blocks, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(planes, eps=1e-05))
        layers = [IBasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes
        layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        with torch.autocast("cuda", enabled=self.fp16):  # torch.cuda.amp.autocast(self.fp16)
            x = self.prelu(self.bn1(self.conv1(x)))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            x = self.dropout(torch.flatten(self.bn2(x), 1))
        return self.features(self.fc(x.float() if self.fp16 else x))


# ---------------------------------------------------------------- backbones/mobilefacenet.py
def conv_block(cin, cout, kernel=1, stride=1, padding=0, groups=1):  # ConvBlock
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, groups=groups, stride=stride, padding=padding, bias=False),
                         nn.BatchNorm2d(cout), nn.PReLU(cout))


def linear_block(cin, cout, kernel=1, stride=1, padding=0, groups=1):  # LinearBlock
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False),
                         nn.BatchNorm2d(cout))


class DepthWise(nn.Module):
    def __init__(self, cin, cout, residual=False, kernel=3, stride=2, padding=1, groups=1):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(conv_block(cin, groups),
                                    conv_block(groups, groups, kernel, stride, padding, groups=groups),
                                    linear_block(groups, cout))

    def forward(self, x):
        return x + self.layers(x) if self.residual else self.layers(x)


def residual(c, num_block, groups):  # Residual: num_block residual DepthWise, 3x3 stride 1
    return nn.Sequential(*[DepthWise(c, c, True, 3, 1, 1, groups) for _ in range(num_block)])


class MobileFaceNet(nn.Module):
    def __init__(self, num_features=512, blocks=(1, 4, 6, 2), scale=2, fp16=False):
        super().__init__()
        self.fp16 = fp16
        c1, c2 = 64 * scale, 128 * scale
        layers = [conv_block(3, c1, 3, 2, 1)]
        layers.append(conv_block(c1, c1, 3, 1, 1, groups=64) if blocks[0] == 1 else residual(c1, blocks[0], 128))
        layers += [DepthWise(c1, c1, False, 3, 2, 1, groups=128), residual(c1, blocks[1], 128),
                   DepthWise(c1, c2, False, 3, 2, 1, groups=256), residual(c2, blocks[2], 256),
                   DepthWise(c2, c2, False, 3, 2, 1, groups=512), residual(c2, blocks[3], 256)]
        self.layers = nn.ModuleList(layers)
        self.conv_sep = conv_block(c2, 512)
        self.features = nn.Sequential(linear_block(512, 512, 7, 1, 0, groups=512), nn.Flatten(),  # GDC
                                      nn.Linear(512, num_features, bias=False), nn.BatchNorm1d(num_features))
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, mode='fan_out', nonlinearity='relu')
                if m.bias is not None:
                    m.bias.data.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.data.fill_(1)
                m.bias.data.zero_()

    def forward(self, x):
        with torch.autocast("cuda", enabled=self.fp16):
            for f in self.layers:
                x = f(x)
        return self.features(self.conv_sep(x.float() if self.fp16 else x))


IRESNET_LAYERS = {"r18": [2, 2, 2, 2], "r50": [3, 4, 14, 3], "r100": [3, 13, 30, 3]}


def get_model(name, num_features=512, fp16=False):
    if name in IRESNET_LAYERS:
        return IResNet(IRESNET_LAYERS[name], dropout=0.0, num_features=num_features, fp16=fp16)
    if name == "mbf":
        return MobileFaceNet(num_features, (1, 4, 6, 2), 2, fp16=fp16)
    raise ValueError(f"unknown network {name!r} (r18, r50, r100, mbf)")


# ---------------------------------------------------------------- losses.py
class CombinedMarginLoss(nn.Module):
    def __init__(self, s, m1, m2, m3, interclass_filtering_threshold=0):
        super().__init__()
        self.s, self.m1, self.m2, self.m3 = s, m1, m2, m3
        assert interclass_filtering_threshold == 0  # train_v2's default; filtering not reproduced

    def forward(self, logits, labels):
        index_positive = torch.where(labels != -1)[0]
        target_logit = logits[index_positive, labels[index_positive].view(-1)]
        if self.m1 == 1.0 and self.m3 == 0.0:  # ArcFace: margin added to the angle, outside autograd
            with torch.no_grad():
                target_logit.arccos_()
                logits.arccos_()
                logits[index_positive, labels[index_positive].view(-1)] = target_logit + self.m2
                logits.cos_()
            return logits * self.s
        if self.m3 > 0:  # CosFace
            logits[index_positive, labels[index_positive].view(-1)] = target_logit - self.m3
            return logits * self.s
        raise ValueError("only the ArcFace and CosFace branches exist")


# ---------------------------------------------------------------- partial_fc_v2.py
class AllGatherFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, *gather_list):
        gather_list = list(gather_list)
        dist.all_gather(gather_list, tensor)
        return tuple(gather_list)

    @staticmethod
    def backward(ctx, *grads):
        grad_list = list(grads)
        rank = dist.get_rank()
        grad_out = grad_list[rank]
        ops = [dist.reduce(grad_out if i == rank else grad_list[i], i, dist.ReduceOp.SUM, async_op=True)
               for i in range(dist.get_world_size())]
        for op in ops:
            op.wait()
        grad_out *= len(grad_list)  # "cooperate with distributed loss function"
        return (grad_out, *[None] * len(grad_list))


class DistCrossEntropyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, label):
        batch_size = logits.size(0)
        max_logits, _ = torch.max(logits, dim=1, keepdim=True)
        dist.all_reduce(max_logits, dist.ReduceOp.MAX)
        logits.sub_(max_logits)
        logits.exp_()
        sum_logits_exp = torch.sum(logits, dim=1, keepdim=True)
        dist.all_reduce(sum_logits_exp, dist.ReduceOp.SUM)
        logits.div_(sum_logits_exp)
        index = torch.where(label != -1)[0]
        loss = torch.zeros(batch_size, 1, device=logits.device)
        loss[index] = logits[index].gather(1, label[index])
        dist.all_reduce(loss, dist.ReduceOp.SUM)
        ctx.save_for_backward(index, logits, label)
        return loss.clamp_min_(1e-30).log_().mean() * (-1)

    @staticmethod
    def backward(ctx, loss_gradient):
        index, logits, label = ctx.saved_tensors
        batch_size = logits.size(0)
        one_hot = torch.zeros(size=[index.size(0), logits.size(1)], device=logits.device)
        one_hot.scatter_(1, label[index], 1)
        logits[index] -= one_hot
        logits.div_(batch_size)
        return logits * loss_gradient.item(), None


class PartialFC_V2(nn.Module):
    def __init__(self, margin_loss, embedding_size, num_classes, sample_rate=1.0, fp16=False, device=None):
        super().__init__()
        assert dist.is_initialized()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.embedding_size, self.sample_rate, self.fp16 = embedding_size, sample_rate, fp16
        self.num_local = num_classes // self.world_size + int(self.rank < num_classes % self.world_size)
        self.class_start = num_classes // self.world_size * self.rank + min(self.rank, num_classes % self.world_size)
        self.num_sample = int(self.sample_rate * self.num_local)
        self.last_batch_size = 0
        # device: where the weight is drawn; arcface_torch draws it on the CPU (device None) and
        # moves the module, which takes minutes at 10M classes (--classifier-only draws on the GPU)
        self.weight = nn.Parameter(torch.normal(0, 0.01, (self.num_local, embedding_size), device=device))
        self.margin_softmax = margin_loss

    def sample(self, labels, index_positive):
        with torch.no_grad():
            positive = torch.unique(labels[index_positive], sorted=True)
            if self.num_sample - positive.size(0) >= 0:
                perm = torch.rand(size=[self.num_local]).to(labels.device)  # .cuda() in arcface_torch
                perm[positive] = 2.0
                index = torch.topk(perm, k=self.num_sample)[1]
                index = index.sort()[0]
            else:
                index = positive
            self.weight_index = index
            labels[index_positive] = torch.searchsorted(index, labels[index_positive])
        return self.weight[self.weight_index]

    def forward(self, local_embeddings, local_labels):
        local_labels.squeeze_()
        local_labels = local_labels.long()
        batch_size = local_embeddings.size(0)
        if self.last_batch_size == 0:
            self.last_batch_size = batch_size
        assert self.last_batch_size == batch_size
        dev = local_embeddings.device  # arcface_torch: .cuda()
        gather_embeddings = [torch.zeros((batch_size, self.embedding_size), device=dev) for _ in range(self.world_size)]
        gather_labels = [torch.zeros(batch_size, device=dev).long() for _ in range(self.world_size)]
        list_embeddings = AllGatherFunc.apply(local_embeddings, *gather_embeddings)
        dist.all_gather(gather_labels, local_labels)
        embeddings = torch.cat(list_embeddings)
        labels = torch.cat(gather_labels).view(-1, 1)
        index_positive = (self.class_start <= labels) & (labels < self.class_start + self.num_local)
        labels[~index_positive] = -1
        labels[index_positive] -= self.class_start
        weight = self.sample(labels, index_positive) if self.sample_rate < 1 else self.weight
        with torch.autocast("cuda", enabled=self.fp16):  # train_v2 builds it with fp16=False
            logits = F.linear(F.normalize(embeddings), F.normalize(weight))
        if self.fp16:
            logits = logits.float()
        logits = logits.clamp(-1, 1)
        logits = self.margin_softmax(logits, labels)
        return DistCrossEntropyFunc.apply(logits, labels)


# ---------------------------------------------------------------- the check (--check)
def gather_rows(t, sizes):
    """All ranks' tensors of different first dimensions, concatenated in rank order."""
    pad = torch.zeros((max(sizes),) + tuple(t.shape[1:]), dtype=t.dtype)
    pad[:t.size(0)] = t
    out = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(out, pad)
    return torch.cat([o[:n] for o, n in zip(out, sizes)])


def check_step(backbone, pfc, img, lab, classes, s=64.0, m=0.5):
    rank, world = dist.get_rank(), dist.get_world_size()
    emb = backbone(img)
    emb.retain_grad()
    e_local, w_local = emb.detach().clone(), pfc.weight.detach().clone()
    loss = pfc(emb, lab.clone())
    loss.backward()
    B = img.size(0)
    sizes = [classes // world + int(r < classes % world) for r in range(world)]
    E = gather_rows(e_local, [B] * world)
    Y = gather_rows(lab.long().view(-1), [B] * world)
    W = gather_rows(w_local, sizes)
    if pfc.sample_rate < 1:  # the classes each rank sampled, as global ids
        idx = pfc.weight_index + pfc.class_start
        n = torch.tensor([idx.numel()])
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n)
        cols = gather_rows(idx, [int(c) for c in counts])
    else:
        cols = torch.arange(classes)
    Er, Wr = E.clone().requires_grad_(), W.clone().requires_grad_()
    target = torch.searchsorted(cols, Y)  # cols is sorted and holds every label
    cos = F.linear(F.normalize(Er), F.normalize(Wr[cols])).clamp(-1, 1)
    rows = torch.arange(cos.size(0))
    with torch.no_grad():  # ArcFace margin: cos(theta + m) on the target; arcface_torch keeps it out of autograd
        delta = torch.zeros_like(cos)
        t = cos[rows, target]
        delta[rows, target] = torch.cos(torch.arccos(t) + m) - t
    ref = F.cross_entropy(s * (cos + delta), target)
    ref.backward()
    sl = slice(pfc.class_start, pfc.class_start + pfc.num_local)
    d_loss = abs(loss.item() - ref.item())
    d_w = (pfc.weight.grad - Wr.grad[sl]).abs().max().item() / max(Wr.grad[sl].abs().max().item(), 1e-30)
    ge = Er.grad[rank * B:(rank + 1) * B] * world
    d_e = (emb.grad - ge).abs().max().item() / max(ge.abs().max().item(), 1e-30)
    ok = d_loss <= 1e-5 and d_w <= 1e-4 and d_e <= 1e-4
    res = torch.tensor([float(not ok)])
    dist.all_reduce(res)  # every rank must agree
    if rank == 0:
        print(f"check ({world} rank{'s' if world > 1 else ''}, sample rate {pfc.sample_rate}, {len(cols)} of {classes} "
              f"classes used): PartialFC_V2 loss {loss.item():.7f}, plain F.cross_entropy {ref.item():.7f}, "
              f"|diff| {d_loss:.2e} (tol 1e-5); weight grad rel. diff {d_w:.2e}, embedding grad rel. diff "
              f"{d_e:.2e} (tol 1e-4): {'OK' if res.item() == 0 else 'FAIL'}", flush=True)
    return res.item() == 0


# ---------------------------------------------------------------- the classifier alone (--classifier-only)
DUMP_STEPS = 2  # two steps: the second carries the first's momentum
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 5e-4


def parse_list(p, flag, text, kind):
    out = []
    for word in text.split(","):
        try:
            out.append(kind(word.strip()))
        except ValueError:
            p.error(f"{flag}: '{word}' is not a{'n integer' if kind is int else ' number'}")
    return out


def classifier_cell(a, dev, cuda, fp16, classes_per_shard, rate, dump_prefix):
    """One cell: PartialFC_V2 over classes_per_shard x world classes at one sample rate, timed.
    Everything it allocates is local, so that it is freed when the cell returns."""
    rank, world = dist.get_rank(), dist.get_world_size()
    classes = classes_per_shard * world
    torch.manual_seed(2048)  # setup_seed(cfg.seed)
    # The weight drawn on the device: the same distribution as arcface_torch's CPU draw,
    # without minutes of it at 10M classes.
    pfc = PartialFC_V2(CombinedMarginLoss(64, 1.0, 0.5, 0.0, 0), 512, classes, rate, a.pfc_fp16, device=dev)
    pfc.train()
    opt = torch.optim.SGD(params=[{"params": pfc.parameters()}], lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    amp = torch.amp.GradScaler(dev.type, growth_interval=100) if fp16 else None
    gen = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(a.batch, 512, generator=gen).to(dev).requires_grad_(),
             torch.randint(0, classes, (a.batch,), generator=gen).to(dev)) for _ in range(max(1, a.batches))]
    k = 0

    def step():
        nonlocal k
        emb, labels = data[k % len(data)]
        k += 1
        loss = pfc(emb, labels)
        if amp is not None:  # train_v2 under cfg.fp16
            amp.scale(loss).backward()
            amp.unscale_(opt)
            amp.step(opt)
            amp.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        emb.grad = None  # the backbone's output is a new tensor every step
        return loss.item()

    if dump_prefix:
        rec = {"weight": pfc.weight.detach().cpu().clone(), "rank": rank, "world_size": world, "classes": classes,
               "class_start": pfc.class_start, "num_local": pfc.num_local, "sample_rate": rate, "s": 64.0, "m": 0.5,
               "lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, "fp16": fp16, "steps": []}
        for i in range(DUMP_STEPS):
            emb, labels = data[k % len(data)]
            e, y = emb.detach().cpu().clone(), labels.cpu().clone()
            loss = step()
            rec["steps"].append({"embeddings": e, "labels": y, "loss": loss,
                                 "weight_index": pfc.weight_index.cpu().clone() if rate < 1 else None,
                                 "weight": pfc.weight.detach().cpu().clone()})
        torch.save(rec, f"{dump_prefix}_rank{rank}.pt")
    for _ in range(a.warmup):
        loss = step()
    per_step = []
    for _ in range(a.windows):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step()
        if cuda:
            torch.cuda.synchronize(dev)
        per_step.append((time.perf_counter() - t0) / a.steps * 1e3)
    return {"classes_per_shard": classes_per_shard, "sample_rate": rate, "num_sample_per_rank": pfc.num_sample,
            "step_ms": sorted(per_step)[len(per_step) // 2], "windows_ms": per_step,
            "peak_memory_mb": torch.cuda.max_memory_allocated(dev) / 2 ** 20 if cuda else None, "last_loss": loss}


def classifier_only(a, shards, rates, dev, cuda, fp16):
    rank, world = dist.get_rank(), dist.get_world_size()
    if not shards:
        shards = [a.classes // world]
        if shards[0] < 1:
            raise SystemExit(f"arcface_torch_step.py: error: --classes {a.classes} over {world} ranks leaves a shard empty")
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
    precision = "fp16" if fp16 else "fp32"
    out = {"mode": "classifier", "who": "arcface_torch", "device": a.device,
           "card": torch.cuda.get_device_name(dev) if cuda else "cpu", "world_size": world, "batch_per_rank": a.batch,
           "dim": 512, "precision": precision, "pfc_fp16": a.pfc_fp16, "threads": torch.get_num_threads(),
           "steps_per_window": a.steps, "windows": a.windows, "warmup": a.warmup, "runs": []}

    def write():
        if rank == 0 and a.json:
            tmp = a.json + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, indent=1)
                f.write("\n")
            os.replace(tmp, a.json)

    last = None  # (classes per shard, seconds) of the cell before: the next one's guess
    for n, (cps, rate) in enumerate((c, r) for c in shards for r in rates):
        cell = {"classes_per_shard": cps, "sample_rate": rate}
        go = torch.tensor([1.0], device=dev)
        if rank == 0 and a.time_limit_s > 0:
            guess = last[1] * max(1.0, cps / last[0]) if last else 0.0
            go.fill_(float(time.monotonic() - _T0 + guess <= a.time_limit_s))
        dist.broadcast(go, 0)  # every rank runs the same cells
        if go.item() == 0:
            out["runs"].append({**cell, "step_ms": None, "peak_memory_mb": None,
                                "not_run": f"time limit ({a.time_limit_s:g} s from the start)"})
            print(f"arcface_torch classifier: {cps} classes/shard, rate {rate}: not run, the time limit of "
                  f"{a.time_limit_s:g} s would pass", flush=True)
            write()
            continue
        t_cell = time.monotonic()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            run = classifier_cell(a, dev, cuda, fp16, cps, rate, os.path.join(a.dump, f"cell{n}") if a.dump else "")
        except torch.OutOfMemoryError as e:
            # Caught per cell: the next (smaller or sampled) cell may fit. The exception's frames
            # hold the cell's tensors until here; they are freed before the next cell.
            run = {**cell, "step_ms": None, "peak_memory_mb": None,
                   "not_run": "out of memory: " + str(e).splitlines()[0][:300]}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        last = (cps, time.monotonic() - t_cell)
        out["runs"].append(run)
        if rank == 0:
            if run.get("not_run"):
                print(f"arcface_torch classifier: {cps} classes/shard, rate {rate}: not run, {run['not_run']}",
                      flush=True)
            else:
                where = torch.cuda.get_device_name(dev) if cuda else f"cpu, threads {torch.get_num_threads()}"
                peak = run["peak_memory_mb"]
                print(f"arcface_torch classifier: {cps} classes/shard x {world}, rate {rate} "
                      f"({run['num_sample_per_rank']} per rank), batch {a.batch}x{world}, {precision}"
                      f"{', pfc fp16' if a.pfc_fp16 else ''}, {where}: {run['step_ms']:.3f} ms/step (median of "
                      f"{a.windows} windows of {a.steps} steps){'' if peak is None else f', peak {peak:.0f} MB'}"
                      f"; last loss {run['last_loss']:.4f}", flush=True)
        write()


# ---------------------------------------------------------------- the train_v2.py step
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--network", default="mbf", choices=["mbf", "r18", "r50", "r100"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu: gloo, fp32; cuda: NCCL, one GPU per rank (LOCAL_RANK)")
    p.add_argument("--precision", default="", choices=["", "fp16", "fp32"],
                   help="fp16: arcface_torch's cfg.fp16 (autocast in the backbone, GradScaler); "
                        "default fp16 on cuda, fp32 on cpu")
    p.add_argument("--batch", type=int, default=32, help="images per rank")
    p.add_argument("--classes", type=int, default=100000)
    p.add_argument("--sample-rate", default="1.0", help="with --classifier-only, a comma-separated list")
    p.add_argument("--steps", type=int, default=5, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batches", type=int, default=4, help="random batches made per rank before timing")
    p.add_argument("--no-fp16-compress", action="store_true", help="leave DDP's fp16_compress_hook out")
    p.add_argument("--json", default="", help="write the result as JSON to this file (rank 0)")
    p.add_argument("--check", action="store_true", help="compare one step's loss/gradients with a plain reference")
    p.add_argument("--classifier-only", action="store_true",
                   help="time PartialFC_V2 and its SGD update alone on random embeddings (see the top of this file)")
    p.add_argument("--classes-per-shard", default="",
                   help="--classifier-only: comma-separated classes per rank (default: --classes / ranks)")
    p.add_argument("--pfc-fp16", action="store_true",
                   help="--classifier-only: PartialFC_V2(fp16=True), its GEMM under fp16 autocast (train_v2: False)")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="--classifier-only: start no cell that would end past this many seconds (0: no limit)")
    p.add_argument("--dump", default="", help="--classifier-only: save each cell's first steps in this folder")
    a = p.parse_args()
    cuda = a.device == "cuda"
    fp16 = (a.precision or ("fp16" if cuda else "fp32")) == "fp16"
    if a.classifier_only:
        # fp16 is the loss scaling alone here (the backbone's autocast is absent): GradScaler
        # runs on the CPU too, which is how the CPU test reaches it.
        if a.pfc_fp16 and not cuda:
            p.error("--pfc-fp16 needs --device cuda (partial_fc_v2.py's autocast is CUDA's)")
        if a.check:
            p.error("--check and --classifier-only are separate runs")
        if a.time_limit_s < 0:
            p.error(f"--time-limit-s must be 0 or more, got {a.time_limit_s:g}")
        shards = parse_list(p, "--classes-per-shard", a.classes_per_shard, int) if a.classes_per_shard else []
        rates = parse_list(p, "--sample-rate", a.sample_rate, float)
        if any(c < 1 for c in shards):
            p.error(f"--classes-per-shard: every entry must be at least 1, got '{a.classes_per_shard}'")
        if any(not 0 < r <= 1 for r in rates):
            p.error(f"--sample-rate: every entry must be in (0, 1], got '{a.sample_rate}'")
    else:
        for flag, given in (("--classes-per-shard", a.classes_per_shard), ("--pfc-fp16", a.pfc_fp16),
                            ("--time-limit-s", a.time_limit_s), ("--dump", a.dump)):
            if given:
                p.error(f"{flag} needs --classifier-only")
        try:
            a.sample_rate = float(a.sample_rate)
        except ValueError:
            p.error(f"--sample-rate: one number without --classifier-only, got '{a.sample_rate}'")
        if fp16 and not cuda:
            p.error("--precision fp16 needs --device cuda (arcface_torch's autocast is CUDA's)")
    if a.check and cuda:
        p.error("--check runs on the CPU")
    for flag, v in (("--batch", a.batch), ("--steps", a.steps), ("--windows", a.windows)):
        if v < 1:
            p.error(f"{flag} must be at least 1, got {v}")

    # Without torchrun: one rank (the rendezvous torchrun --standalone would set up).
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    # torch's note that _set_static_graph() makes find_unused_parameters=True redundant (train_v2 sets both)
    warnings.filterwarnings("ignore", message="You passed find_unused_parameters=true")
    if cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")  # torchrun's environment: MASTER_ADDR/PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.classifier_only:
        classifier_only(a, shards, rates, dev, cuda, fp16)
        dist.destroy_process_group()
        return
    torch.manual_seed(2048)  # setup_seed(cfg.seed): the same on every rank before building the models

    backbone = get_model(a.network, 512, fp16=fp16).to(dev)
    backbone = torch.nn.parallel.DistributedDataParallel(
        module=backbone, broadcast_buffers=False, device_ids=[dev.index] if cuda else None,
        bucket_cap_mb=16, find_unused_parameters=True)
    if not a.no_fp16_compress:
        backbone.register_comm_hook(None, fp16_compress_hook)
    backbone.train()
    backbone._set_static_graph()
    margin_loss = CombinedMarginLoss(64, 1.0, 0.5, 0.0, 0)
    module_partial_fc = PartialFC_V2(margin_loss, 512, a.classes, a.sample_rate, False)
    module_partial_fc.train().to(dev)
    opt = torch.optim.SGD(params=[{"params": backbone.parameters()}, {"params": module_partial_fc.parameters()}],
                          lr=0.1, momentum=0.9, weight_decay=5e-4)
    # PolynomialLRWarmup(power 1) without warm-up, over a horizon far beyond the run: a linear decay
    total = 10 ** 6
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 - min(t, total) / total)
    amp = torch.amp.GradScaler("cuda", growth_interval=100) if fp16 else None

    gen = torch.Generator().manual_seed(1000 + rank)
    data = [(torch.randn(a.batch, 3, 112, 112, generator=gen).to(dev),
             torch.randint(0, a.classes, (a.batch,), generator=gen).to(dev)) for _ in range(max(1, a.batches))]

    if a.check:
        ok = check_step(backbone, module_partial_fc, *data[0], a.classes)
        dist.destroy_process_group()
        raise SystemExit(0 if ok else 1)

    phase = dict(forward_backbone=0.0, forward_partial_fc=0.0, backward=0.0, optimizer=0.0)
    marks = []  # CUDA: the events of each timed step, read after its window
    k = 0

    def mark():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def step(timed):
        nonlocal k
        img, local_labels = data[k % len(data)]
        k += 1
        t0 = mark()
        local_embeddings = backbone(img)
        t1 = mark()
        loss = module_partial_fc(local_embeddings, local_labels)
        t2 = mark()
        if fp16:
            amp.scale(loss).backward()
            t3 = mark()
            amp.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            amp.step(opt)
            amp.update()
            opt.zero_grad()
        else:
            loss.backward()
            t3 = mark()
            torch.nn.utils.clip_grad_norm_(backbone.parameters(), 5)
            opt.step()
            opt.zero_grad()
        lr_scheduler.step()
        t4 = mark()
        loss_value = loss.item()  # train_v2: loss_am.update(loss.item(), 1) every step
        if timed:
            marks.append((t0, t1, t2, t3, t4))
        return loss_value

    def collect():
        if cuda:
            torch.cuda.synchronize()
        for t0, t1, t2, t3, t4 in marks:
            for key, (u, v) in zip(phase, ((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
                phase[key] += u.elapsed_time(v) / 1e3 if cuda else v - u
        marks.clear()

    for _ in range(a.warmup):
        loss = step(False)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
    rates = []
    for _ in range(a.windows):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step(True)
        if cuda:
            torch.cuda.synchronize()
        rates.append(a.steps * a.batch * world / (time.perf_counter() - t0))
        collect()
    median = sorted(rates)[len(rates) // 2]
    n = a.steps * a.windows
    tot = sum(phase.values())
    pct = {key: 100.0 * v / tot if tot > 0 else 0.0 for key, v in phase.items()}
    threads = torch.get_num_threads()
    n_sample = module_partial_fc.num_sample
    peak_mb = torch.cuda.max_memory_allocated(dev) / 2 ** 20 if cuda else None
    precision = "fp16" if fp16 else "fp32"
    if rank == 0:
        where = torch.cuda.get_device_name(dev) if cuda else f"cpu, threads {threads}"
        print(f"arcface_torch step: {a.network}, batch {a.batch}x{world}, {a.classes} classes ({n_sample} sampled "
              f"per rank), sample rate {a.sample_rate}, {precision}, {where}: {median:.1f} images/s (median of "
              f"{a.windows} windows of {a.steps} steps); per step {tot / n * 1e3:.1f} ms = forward "
              f"{pct['forward_backbone'] + pct['forward_partial_fc']:.0f}% (backbone {pct['forward_backbone']:.0f}%, "
              f"partial fc {pct['forward_partial_fc']:.0f}%), backward {pct['backward']:.0f}%, optimizer "
              f"{pct['optimizer']:.0f}%{'' if peak_mb is None else f'; peak {peak_mb:.0f} MB (GPU allocated)'}; "
              f"last loss {loss:.4f}{'' if not a.no_fp16_compress else '; no fp16 compress hook'}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"who": "arcface_torch", "network": a.network, "device": a.device,
                           "card": torch.cuda.get_device_name(dev) if cuda else "cpu", "world_size": world,
                           "batch_per_rank": a.batch, "batch": a.batch, "classes": a.classes,
                           "sample_rate": a.sample_rate, "precision": precision, "num_sample_per_rank": n_sample,
                           "threads": threads, "fp16_compress_hook": not a.no_fp16_compress,
                           "images_per_s": median, "windows": rates, "steps_per_window": a.steps,
                           "warmup": a.warmup, "step_ms": tot / n * 1e3, "peak_memory_mb": peak_mb,
                           "last_loss": loss,
                           "phases": {key + "_ms": v / n * 1e3 for key, v in phase.items()}}, f, indent=1)
                f.write("\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
