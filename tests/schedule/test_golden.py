"""Golden before/after listings, one per transformation (regenerate by printing `CASES[name]()`; review diffs)."""

import pytest

from tests.schedule.golden_cases import CASES

GOLDEN = {
    'split': '''\
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] R, lr: f32 R, mu: f32 R)
  mul1        = mu * buf             : f32[8] R
  all_reduce1 = all_reduce(g, mean)  : f32[8] R
  add1        = mul1 + all_reduce1   : f32[8] R
  buf_new     = update(buf, add1)    : f32[8] R
  mul2        = lr * buf_new         : f32[8] R
  sub1        = w - mul2             : f32[8] R
  w_new       = update(w, sub1)      : f32[8] R
  return w=w_new, buf=buf_new
--- split(all_reduce1) -> all_reduce1_rs, all_reduce1_ag
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] R, lr: f32 R, mu: f32 R)
  mul1           = mu * buf                    : f32[8] R
  all_reduce1_rs = reduce_scatter(g, mean)     : f32[8] S[0]
  all_reduce1_ag = all_gather(all_reduce1_rs)  : f32[8] R
  add1           = mul1 + all_reduce1_ag       : f32[8] R
  buf_new        = update(buf, add1)           : f32[8] R
  mul2           = lr * buf_new                : f32[8] R
  sub1           = w - mul2                    : f32[8] R
  w_new          = update(w, sub1)             : f32[8] R
  return w=w_new, buf=buf_new
''',
    'reorder': '''\
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] R, lr: f32 R, mu: f32 R)
  mul1           = mu * buf                    : f32[8] R
  all_reduce1_rs = reduce_scatter(g, mean)     : f32[8] S[0]
  all_reduce1_ag = all_gather(all_reduce1_rs)  : f32[8] R
  add1           = mul1 + all_reduce1_ag       : f32[8] R
  buf_new        = update(buf, add1)           : f32[8] R
  mul2           = lr * buf_new                : f32[8] R
  sub1           = w - mul2                    : f32[8] R
  w_new          = update(w, sub1)             : f32[8] R
  return w=w_new, buf=buf_new
--- reorder([...], all_reduce1_ag)
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] R, lr: f32 R, mu: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  buf_s          = scatter(buf)             : f32[8] S[0]
  mul1           = mu * buf_s               : f32[8] S[0]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  add1           = mul1 + all_reduce1_rs    : f32[8] S[0]
  mul2           = lr * add1                : f32[8] S[0]
  sub1           = w_s - mul2               : f32[8] S[0]
  sub1_ag        = all_gather(sub1)         : f32[8] R
  w_new          = update(w, sub1_ag)       : f32[8] R
  add1_ag        = all_gather(add1)         : f32[8] R
  buf_new        = update(buf, add1_ag)     : f32[8] R
  return w=w_new, buf=buf_new
''',
    'as_slice': '''\
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] R, lr: f32 R, mu: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  buf_s          = scatter(buf)             : f32[8] S[0]
  mul1           = mu * buf_s               : f32[8] S[0]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  add1           = mul1 + all_reduce1_rs    : f32[8] S[0]
  mul2           = lr * add1                : f32[8] S[0]
  sub1           = w_s - mul2               : f32[8] S[0]
  sub1_ag        = all_gather(sub1)         : f32[8] R
  w_new          = update(w, sub1_ag)       : f32[8] R
  add1_ag        = all_gather(add1)         : f32[8] R
  buf_new        = update(buf, add1_ag)     : f32[8] R
  return w=w_new, buf=buf_new
--- as_slice([buf])
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] S[0], lr: f32 R, mu: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  mul1           = mu * buf                 : f32[8] S[0]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  add1           = mul1 + all_reduce1_rs    : f32[8] S[0]
  mul2           = lr * add1                : f32[8] S[0]
  sub1           = w_s - mul2               : f32[8] S[0]
  sub1_ag        = all_gather(sub1)         : f32[8] R
  w_new          = update(w, sub1_ag)       : f32[8] R
  buf_new        = update(buf, add1)        : f32[8] S[0]
  return w=w_new, buf=buf_new
''',
    'fuse': '''\
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] S[0], lr: f32 R, mu: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  mul1           = mu * buf                 : f32[8] S[0]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  add1           = mul1 + all_reduce1_rs    : f32[8] S[0]
  mul2           = lr * add1                : f32[8] S[0]
  sub1           = w_s - mul2               : f32[8] S[0]
  sub1_ag        = all_gather(sub1)         : f32[8] R
  w_new          = update(w, sub1_ag)       : f32[8] R
  buf_new        = update(buf, add1)        : f32[8] S[0]
  return w=w_new, buf=buf_new
--- fuse(all stages)
program momentum(g: f32[8] L, w: f32[8] R, buf: f32[8] S[0], lr: f32 R, mu: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  mul1           = mu * buf                 : f32[8] S[0]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  add1           = mul1 + all_reduce1_rs    : f32[8] S[0]
  mul2           = lr * add1                : f32[8] S[0]
  sub1           = w_s - mul2               : f32[8] S[0]
  sub1_ag        = all_gather(sub1)         : f32[8] R
  w_new          = update(w, sub1_ag)       : f32[8] R
  buf_new        = update(buf, add1)        : f32[8] S[0]
  fuse(w_s, mul1, all_reduce1_rs, add1, mul2, sub1, sub1_ag, w_new, buf_new) kind=collective
  return w=w_new, buf=buf_new
''',
    'fuse_kernel': '''\
program sgd(g: f32[8] L, w: f32[8] R, lr: f32 R)
  all_reduce1 = all_reduce(g, mean)  : f32[8] R
  mul1        = lr * all_reduce1     : f32[8] R
  sub1        = w - mul1             : f32[8] R
  w_new       = update(w, sub1)      : f32[8] R
  return w=w_new
--- fuse([mul1, sub1, w_new])
program sgd(g: f32[8] L, w: f32[8] R, lr: f32 R)
  all_reduce1 = all_reduce(g, mean)  : f32[8] R
  mul1        = lr * all_reduce1     : f32[8] R
  sub1        = w - mul1             : f32[8] R
  w_new       = update(w, sub1)      : f32[8] R
  fuse(mul1, sub1, w_new) kind=kernel
  return w=w_new
''',
    'overlap': '''\
program megatron_mlp(x: f32[8, 8] R, w1: f32[8, 16] S[1], w2: f32[16, 8] S[0], b: f32[8] R)
  matmul1     = matmul(x, w1)                 : f32[8, 16] S[1]
  maximum1    = maximum(matmul1, 0)           : f32[8, 16] S[1]
  matmul2     = matmul(maximum1, w2)          : f32[8, 8] L
  all_reduce1 = all_reduce(matmul2, sum)      : f32[8, 8] R
  add1        = all_reduce1 + b               : f32[8, 8] R
  dropout1    = dropout(add1, p=0.1, seed=0)  : f32[8, 8] R
  add2        = dropout1 + x                  : f32[8, 8] R
  return out=add2
--- overlap([matmul2, all_reduce1, add1, dropout1, add2], chunks=2)
program megatron_mlp(x: f32[8, 8] R, w1: f32[8, 16] S[1], w2: f32[16, 8] S[0], b: f32[8] R)
  matmul1     = matmul(x, w1)                 : f32[8, 16] S[1]
  maximum1    = maximum(matmul1, 0)           : f32[8, 16] S[1]
  matmul2     = matmul(maximum1, w2)          : f32[8, 8] L
  all_reduce1 = all_reduce(matmul2, sum)      : f32[8, 8] R
  add1        = all_reduce1 + b               : f32[8, 8] R
  dropout1    = dropout(add1, p=0.1, seed=0)  : f32[8, 8] R
  add2        = dropout1 + x                  : f32[8, 8] R
  overlap(matmul2, all_reduce1, add1, dropout1, add2) chunks=2
  return out=add2
''',
    'dce': '''\
program dce(x: f32[8] L)
  reduce_scatter1 = reduce_scatter(x, sum)       : f32[8] S[0]
  all_gather1     = all_gather(reduce_scatter1)  : f32[8] R
  scatter1        = scatter(all_gather1)         : f32[8] S[0]
  mul1            = scatter1 * 2                 : f32[8] S[0]
  all_reduce1     = all_reduce(x, sum)           : f32[8] R
  return y=mul1, z=all_reduce1
--- dce(keep=[y])
program dce(x: f32[8] L)
  reduce_scatter1 = reduce_scatter(x, sum)  : f32[8] S[0]
  mul1            = reduce_scatter1 * 2     : f32[8] S[0]
  return y=mul1
''',
    'adam': '''\
program adam(g: f32[8] L, w: f32[8] R, m: f32[8] R, v: f32[8] R, lr: f32 R, beta1: f32 R, beta2: f32 R, eps: f32 R, wd: f32 R, c1: f32 R, c2: f32 R)
  mul1        = lr * wd              : f32 R
  sub1        = 1 - mul1             : f32 R
  mul2        = w * sub1             : f32[8] R
  mul3        = beta1 * m            : f32[8] R
  sub2        = 1 - beta1            : f32 R
  all_reduce1 = all_reduce(g, mean)  : f32[8] R
  mul4        = sub2 * all_reduce1   : f32[8] R
  add1        = mul3 + mul4          : f32[8] R
  m_new       = update(m, add1)      : f32[8] R
  div1        = m_new / c1           : f32[8] R
  mul5        = lr * div1            : f32[8] R
  mul6        = beta2 * v            : f32[8] R
  sub3        = 1 - beta2            : f32 R
  mul7        = sub3 * all_reduce1   : f32[8] R
  mul8        = mul7 * all_reduce1   : f32[8] R
  add2        = mul6 + mul8          : f32[8] R
  v_new       = update(v, add2)      : f32[8] R
  div2        = v_new / c2           : f32[8] R
  sqrt1       = sqrt(div2)           : f32[8] R
  add3        = sqrt1 + eps          : f32[8] R
  div3        = mul5 / add3          : f32[8] R
  sub4        = mul2 - div3          : f32[8] R
  w_new       = update(w, sub4)      : f32[8] R
  return w=w_new, m=m_new, v=v_new
--- schedule of adam (4 directives)
  split(all_reduce1)
  reorder([mul2, mul3, mul4, add1, m_new, div1, mul5, mul6, mul7, mul8, add2, v_new, div2, sqrt1, add3, div3, sub4, w_new], all_reduce1_ag)
  as_slice([m, v])
  fuse([w_s, mul1, sub1, mul2, mul3, sub2, all_reduce1_rs, mul4, add1, div1, mul5, mul6, sub3, mul7, mul8, add2, div2, sqrt1, add3, div3, sub4, sub4_ag, w_new, m_new, v_new])
program adam(g: f32[8] L, w: f32[8] R, m: f32[8] S[0], v: f32[8] S[0], lr: f32 R, beta1: f32 R, beta2: f32 R, eps: f32 R, wd: f32 R, c1: f32 R, c2: f32 R)
  w_s            = scatter(w)               : f32[8] S[0]
  mul1           = lr * wd                  : f32 R
  sub1           = 1 - mul1                 : f32 R
  mul2           = w_s * sub1               : f32[8] S[0]
  mul3           = beta1 * m                : f32[8] S[0]
  sub2           = 1 - beta1                : f32 R
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[8] S[0]
  mul4           = sub2 * all_reduce1_rs    : f32[8] S[0]
  add1           = mul3 + mul4              : f32[8] S[0]
  div1           = add1 / c1                : f32[8] S[0]
  mul5           = lr * div1                : f32[8] S[0]
  mul6           = beta2 * v                : f32[8] S[0]
  sub3           = 1 - beta2                : f32 R
  mul7           = sub3 * all_reduce1_rs    : f32[8] S[0]
  mul8           = mul7 * all_reduce1_rs    : f32[8] S[0]
  add2           = mul6 + mul8              : f32[8] S[0]
  div2           = add2 / c2                : f32[8] S[0]
  sqrt1          = sqrt(div2)               : f32[8] S[0]
  add3           = sqrt1 + eps              : f32[8] S[0]
  div3           = mul5 / add3              : f32[8] S[0]
  sub4           = mul2 - div3              : f32[8] S[0]
  sub4_ag        = all_gather(sub4)         : f32[8] R
  w_new          = update(w, sub4_ag)       : f32[8] R
  m_new          = update(m, add1)          : f32[8] S[0]
  v_new          = update(v, add2)          : f32[8] S[0]
  fuse(w_s, mul1, sub1, mul2, mul3, sub2, all_reduce1_rs, mul4, add1, div1, mul5, mul6, sub3, mul7, mul8, add2, div2, sqrt1, add3, div3, sub4, sub4_ag, w_new, m_new, v_new) kind=collective
  return w=w_new, m=m_new, v=v_new
--- lower
plan adam (1 steps)
   0: fused_collective(all_reduce1_rs -> [w_s, mul1, sub1, mul2, mul3, sub2, mul4, add1, div1, mul5, mul6, sub3, mul7, mul8, add2, div2, sqrt1, add3, div3, sub4, w_new, m_new, v_new] -> sub4_ag)
''',
    'pipeline': '''\
program pipeline(y: f32[8, 8] L, b: f32[8] R)
  all_reduce1 = all_reduce(y, sum, groups=2)  : f32[8, 8] R
  add1        = all_reduce1 + b               : f32[8, 8] R
  dropout1    = dropout(add1, p=0.1, seed=0)  : f32[8, 8] R
  send1       = send(dropout1, groups=2)      : f32[8, 8] R
  return recv=send1
--- schedule of pipeline (3 directives)
  split(all_reduce1)
  reorder([add1, dropout1, send1], all_reduce1_ag)
  overlap([all_reduce1_rs, add1, dropout1, send1, send1_ag], chunks=4)
program pipeline(y: f32[8, 8] L, b: f32[8] R)
  all_reduce1_rs = reduce_scatter(y, sum, groups=2)  : f32[8, 8] S[0]
  add1           = all_reduce1_rs + b                : f32[8, 8] S[0]
  dropout1       = dropout(add1, p=0.1, seed=0)      : f32[8, 8] S[0]
  send1          = send(dropout1, groups=2)          : f32[8, 8] S[0]
  send1_ag       = all_gather(send1, groups=2)       : f32[8, 8] R
  overlap(all_reduce1_rs, add1, dropout1, send1, send1_ag) chunks=4
  return recv=send1_ag
--- lower
plan pipeline (1 steps)
   0: overlap(all_reduce1_rs, add1, dropout1, send1, send1_ag, chunks=4)
''',
    'overlap_fused': '''\
program megatron_mlp(x: f32[8, 8] R, w1: f32[8, 16] S[1], w2: f32[16, 8] S[0], b: f32[8] R)
  matmul1     = matmul(x, w1)                 : f32[8, 16] S[1]
  maximum1    = maximum(matmul1, 0)           : f32[8, 16] S[1]
  matmul2     = matmul(maximum1, w2)          : f32[8, 8] L
  all_reduce1 = all_reduce(matmul2, sum)      : f32[8, 8] R
  add1        = all_reduce1 + b               : f32[8, 8] R
  dropout1    = dropout(add1, p=0.1, seed=0)  : f32[8, 8] R
  add2        = dropout1 + x                  : f32[8, 8] R
  return out=add2
--- schedule of megatron_mlp (4 directives)
  split(all_reduce1)
  reorder([add1, dropout1, add2], all_reduce1_ag)
  fuse([all_reduce1_rs, add2_ag])
  overlap([matmul2, all_reduce1_rs, add1, dropout1, add2, add2_ag], chunks=2)
program megatron_mlp(x: f32[8, 8] R, w1: f32[8, 16] S[1], w2: f32[16, 8] S[0], b: f32[8] R)
  matmul1        = matmul(x, w1)                 : f32[8, 16] S[1]
  maximum1       = maximum(matmul1, 0)           : f32[8, 16] S[1]
  matmul2        = matmul(maximum1, w2)          : f32[8, 8] L
  all_reduce1_rs = reduce_scatter(matmul2, sum)  : f32[8, 8] S[0]
  add1           = all_reduce1_rs + b            : f32[8, 8] S[0]
  dropout1       = dropout(add1, p=0.1, seed=0)  : f32[8, 8] S[0]
  x_s            = scatter(x)                    : f32[8, 8] S[0]
  add2           = dropout1 + x_s                : f32[8, 8] S[0]
  add2_ag        = all_gather(add2)              : f32[8, 8] R
  fuse(all_reduce1_rs, add1, dropout1, x_s, add2, add2_ag) kind=collective
  overlap(matmul2, all_reduce1_rs, add1, dropout1, x_s, add2, add2_ag) chunks=2
  return out=add2_ag
--- lower
plan megatron_mlp (2 steps)
   0: kernel(matmul1, maximum1)
   1: overlap(matmul2, fused_collective(all_reduce1_rs -> [add1, dropout1, x_s, add2] -> add2_ag), chunks=2)
''',
    'split_flat': '''\
program flat(g: f32[6, 10] L, w: f32[6, 10] R)
  all_reduce1 = all_reduce(g, mean)  : f32[6, 10] R
  mul1        = 0.1 * all_reduce1    : f32[6, 10] R
  sub1        = w - mul1             : f32[6, 10] R
  w_new       = update(w, sub1)      : f32[6, 10] R
  return w=w_new
--- split(all_reduce1, dim=FLAT) -> all_reduce1_rs, all_reduce1_ag; reorder([mul1, sub1, w_new], all_reduce1_ag)
program flat(g: f32[6, 10] L, w: f32[6, 10] R)
  w_s            = scatter(w)               : f32[6, 10] S[flat]
  all_reduce1_rs = reduce_scatter(g, mean)  : f32[6, 10] S[flat]
  mul1           = 0.1 * all_reduce1_rs     : f32[6, 10] S[flat]
  sub1           = w_s - mul1               : f32[6, 10] S[flat]
  sub1_ag        = all_gather(sub1)         : f32[6, 10] R
  w_new          = update(w, sub1_ag)       : f32[6, 10] R
  return w=w_new
''',
}


@pytest.mark.parametrize('name', list(CASES))
def test_golden_listing(name):
    assert CASES[name]() + '\n' == GOLDEN[name]
