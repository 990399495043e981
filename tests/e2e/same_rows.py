"""The classifier rows and momentum of a 2-rank checkpoint equal those of its 3-rank reshard,
read back with Python's torch.load. usage: same_rows.py DIR_2_RANKS DIR_3_RANKS"""
import glob, sys, torch
def rows(d, key):
    parts = []
    for f in glob.glob(d + '/fc_shard_*.pt'):
        sd = torch.load(f)
        parts.append((int(sd['rows.start']), sd[key]))
    return len(parts), torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])])
for key in ('rows/weight', 'rows/opt.momentum'):
    n2, a = rows(sys.argv[1], key); n3, b = rows(sys.argv[2], key)
    assert (n2, n3) == (2, 3), (n2, n3)
    assert torch.equal(a, b), key
print('classifier rows and momentum of 2 shards == 3 shards (%d classes)' % a.shape[0])
