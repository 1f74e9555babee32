// fasttrain.memory in the browser: a line-by-line port of playbook.py, precise.py and cost.py.
// One source of truth: tests/test_memory_page.py evaluates every function here in headless
// Chromium on random and preset setups and compares each number with the Python module.
// Setup objects use the Python field names (heads, kv_heads, micro_batch, hidden, ffn, ...).
"use strict";
const FTMemory = (() => {
  const MiB = 1024 * 1024;
  const CHOICES = {
    precision: ["fp32", "mixed", "amp"], recompute: ["none", "selective", "full"], ffn_act: ["relu", "gelu", "swiglu"],
    norm: ["rms", "layer"], pos: ["rope", "learned"], attention: ["eager", "flash"], optimizer: ["foreach", "fused"],
  };
  const FLAG = { micro_batch: "--micro-batch", opt_bytes: "--opt-bytes", kv_heads: "--kv-heads", ffn_act: "--ffn-act" };
  const flag = (name) => FLAG[name] || "--" + name;
  const kvHeads = (s) => (s.kv_heads === null || s.kv_heads === undefined ? s.heads : s.kv_heads);
  const isInt = (x) => typeof x === "number" && Number.isInteger(x);

  // config.check: the same conditions and messages
  function check(s, mode) {
    for (const name of ["heads", "micro_batch", "hidden", "ffn", "layers", "seq", "vocab", "tp", "dp"]) {
      const v = s[name];
      if (!isInt(v) || v <= 0) throw new Error(`${flag(name)} must be a positive integer, got ${v}`);
    }
    if (!isInt(s.opt_bytes) || s.opt_bytes < 0) throw new Error(`--opt-bytes must be a non-negative integer, got ${s.opt_bytes}`);
    const g = kvHeads(s);
    if (!isInt(g) || g <= 0) throw new Error(`--kv-heads must be a positive integer, got ${g}`);
    if (s.hidden % s.heads) throw new Error(`heads (${s.heads}) must divide the hidden size (${s.hidden}); pick --heads among the divisors of ${s.hidden}`);
    if (s.heads % s.tp) throw new Error(`tensor parallelism t=${s.tp} must divide the heads (${s.heads}); pick --tp among the divisors of ${s.heads}`);
    if (s.heads % g) throw new Error(`key/value heads (${g}) must divide the heads (${s.heads})`);
    if (g % s.tp && s.tp % g) throw new Error(`tensor parallelism t=${s.tp} and key/value heads ${g}: one must divide the other`);
    if (s.ffn % s.tp) throw new Error(`tensor parallelism t=${s.tp} must divide the feed-forward size (${s.ffn})`);
    if ((s.hidden / s.heads) % 2 && s.pos === "rope" && mode === "precise") throw new Error(`rotary embeddings need an even head size; hidden/heads = ${s.hidden / s.heads}`);
    for (const [name, allowed] of Object.entries(CHOICES)) {
      if (!allowed.includes(s[name])) throw new Error(`${flag(name)} must be one of ${allowed.join(", ")}, got '${s[name]}'`);
    }
    if (![0, 1, 2, 3].includes(s.zero)) throw new Error(`--zero must be 0, 1, 2 or 3, got ${s.zero}`);
    if (!(s.workspace_mib >= 0)) throw new Error(`--workspace-mib must be >= 0, got ${s.workspace_mib}`);
    if (mode === "playbook" && s.precision === "amp") throw new Error("precision 'amp' (PyTorch autocast) exists only in --mode precise; the widget knows fp32 and --mixed");
    return s;
  }

  // ---------------------------------------------------------------- playbook.py
  function pbParamCount(s) {
    const h = s.hidden, v = s.vocab, sl = s.seq, L = s.layers;
    const embeddings = h * (v + sl);
    const oneLayer = 12 * h ** 2 + 13 * h;
    return embeddings + L * oneLayer + 2 * h;
  }
  function pbParamGradOpt(s) {
    const n = pbParamCount(s);
    const mixed = s.precision === "mixed";
    const k = s.opt_bytes + (mixed ? 4 : 0);
    const per = mixed ? 2 : 4, d = s.dp;
    return {
      parameters: s.zero >= 3 ? per * n / d : per * n,
      gradients: s.zero >= 2 ? per * n / d : per * n,
      optimizer: s.zero >= 1 ? k * n / d : k * n,
    };
  }
  function pbActivationTerms(s) {
    const a = s.heads, b = s.micro_batch, h = s.hidden, f = s.ffn, sl = s.seq, v = s.vocab, t = s.tp;
    const B = s.precision === "mixed" ? 2 : 4, sp = s.seq_parallel;
    let attention;
    if (s.recompute === "none" || s.recompute === "full") {
      attention = sp ? sl * b * h / t * (B * 5 + 1) + ((2 * B + 1) * a * sl * sl * b)
                     : sl * b * h * (B * 4 / t + B + 1) + ((2 * B + 1) * a * sl * sl * b / t);
    } else {
      attention = sp ? sl * b * h / t * (B * 5 + 1) : sl * b * h * (B * 4 / t + B + 1);
    }
    const first = sp ? sl * b * h * B / t : sl * b * h * B;
    const drop = sp ? sl * b * h / t : sl * b * h;
    const second = sl * b * f * B / t;
    let ffn;
    if (s.ffn_act === "relu") ffn = first + second + drop;
    else if (s.ffn_act === "gelu") ffn = first + second + sl * b * f * B / t + drop;
    else ffn = first + second + sl * b * f * B * 3 / t + drop;
    const layerNorm = sp ? sl * b * h * B / t : sl * b * h * B;
    const out = {
      input_dropout: sp ? sl * b * h / t : sl * b * h,
      output_layernorm: sp ? sl * b * h * B / t : sl * b * h * B,
      output_projection: sp ? sl * b * h * B / t : sl * b * h * B,
      cross_entropy: sp ? sl * b * v * 4 / t : sl * b * v * 4,
    };
    if (s.recompute === "full") return Object.assign({ layer_input: sl * b * h * B * s.layers }, out);
    return Object.assign({ attention, feedforward: ffn, layernorm: 2 * layerNorm }, out);
  }
  function pbActivationTotal(s) {
    const t = pbActivationTerms(s);
    let total = 0.0;
    if (s.recompute === "full") {
      for (const k of ["layer_input", "input_dropout", "output_layernorm", "output_projection", "cross_entropy"]) total += t[k];
      return total;
    }
    for (let i = 0; i < s.layers; i++) total += 0 + t.attention + t.feedforward + t.layernorm;
    for (const k of ["input_dropout", "output_layernorm", "output_projection", "cross_entropy"]) total += t[k];
    return total;
  }
  function playbook(s) {
    check(s, "playbook");
    const pgo = pbParamGradOpt(s), t = pbActivationTerms(s), act = pbActivationTotal(s), L = s.layers;
    const pgoSum = 0.0 + pgo.parameters + pgo.gradients + pgo.optimizer;
    const children = s.recompute === "full" ? [["layer inputs (x L)", t.layer_input]]
      : [["attention (x L)", t.attention * L], ["feed-forward (x L)", t.feedforward * L], ["layer norms (x L)", t.layernorm * L]];
    children.push(["input dropout", t.input_dropout], ["output layer norm", t.output_layernorm],
      ["output projection", t.output_projection], ["cross-entropy logits (fp32)", t.cross_entropy]);
    return {
      mode: "playbook", total: 0.0 + act + pgoSum, params: pbParamCount(s), peak_moment: null,
      lines: [
        { name: "parameters", bytes: pgo.parameters, in_total: true },
        { name: "gradients", bytes: pgo.gradients, in_total: true },
        { name: "optimizer", bytes: pgo.optimizer, in_total: true },
        { name: "activations", bytes: act, in_total: true, children: children.map(([n, b]) => ({ name: n, bytes: b })) },
      ],
    };
  }
  // formatBytes of the widget: 1024-based, KB/MB/GB labels, toFixed(2) (half-up on the exact binary value)
  function formatBytes(bytes) {
    const sizes = ["Bytes", "KB", "MB", "GB", "TB", "PB"];
    if (bytes === 0) return "0 Bytes";
    const i = parseInt(Math.floor(Math.log(bytes) / Math.log(1024)), 10);
    return `${(bytes / (1024 ** i)).toFixed(2)} ${sizes[i]}`;
  }
  function formatGiB(value) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let i = 0, x = value;
    while (Math.abs(x) >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    return i === 0 ? `${x.toFixed(0)} B` : `${x.toFixed(2)} ${units[i]}`;
  }

  // ---------------------------------------------------------------- precise.py
  function dims(s) {
    const t = s.tp, d = s.hidden / s.heads, g = kvHeads(s);
    const gl = g % t === 0 ? g / t : 1;
    return { t, r: s.seq_parallel ? t : 1, d, a_l: s.heads / t, hl: (s.heads / t) * d, kvl: gl * d,
             f_l: s.ffn / t, v_l: Math.ceil(s.vocab / t), N: s.seq * s.micro_batch };
  }
  function dtypes(s) {
    const mixed = s.precision === "mixed", amp = s.precision === "amp";
    return { param: mixed ? 2 : 4, grad: mixed ? 2 : 4, opt: s.opt_bytes + (mixed ? 4 : 0), R: mixed ? 2 : 4,
             C: s.precision === "fp32" ? 4 : 2, Dsm: mixed ? 2 : 4, cast: amp, stat: 4 * (s.norm === "rms" ? 1 : 2) };
  }
  function paramCounts(s, tArg) {
    const t = tArg === undefined ? s.tp : tArg;
    const g = kvHeads(s);
    const h = s.hidden, d = s.hidden / s.heads, f = s.ffn / t;
    const hl = (s.heads / t) * d, gl = g % t === 0 ? g / t : 1;
    const kvl = gl * d, vl = Math.ceil(s.vocab / t);
    const nUp = s.ffn_act === "swiglu" ? 2 : 1;
    const attn_w = h * (hl + 2 * kvl) + hl * h;
    const mlp_w = nUp * h * f + f * h;
    const attn_b = s.bias ? (hl + 2 * kvl) + h : 0;
    const mlp_b = s.bias ? nUp * f + h : 0;
    const norm = h + (s.norm === "layer" && s.bias ? h : 0);
    const layer = attn_w + attn_b + mlp_w + mlp_b + 2 * norm;
    const embed = vl * h, pos = s.pos === "learned" ? s.seq * h : 0, head = s.tied ? 0 : vl * h;
    return { attn_w, attn_b, mlp_w, mlp_b, norm, layer, embed, pos, head, final_norm: norm,
             total: s.layers * layer + embed + pos + head + norm };
  }
  function eagerCore(Dsm, C, cast, dropout, mask, kernelTemps) {
    const pv = cast ? C : Dsm;
    const kept = Dsm + (dropout ? mask + pv : (cast ? C : 0));
    const events = [[kept + pv, 2]];
    let live = kept - ((dropout || cast) ? pv : 0) + pv;
    if (cast) { events.push([live + Dsm, 0]); live = live - pv + Dsm; }
    if (dropout) { events.push([live + Dsm, 0]); live = live - Dsm - mask + Dsm; }
    events.push([live + Dsm + (kernelTemps ? Dsm : 0), 0]);
    live = Dsm;
    if (cast) events.push([live + C, 0]);
    events.push([2 * C, 0]);
    let fwd = C + (cast ? Dsm : 0);
    if (dropout && cast) fwd = Math.max(fwd, Dsm);
    return [kept, events, fwd];
  }
  function layerTerms(s, maskBytes, kernelTemps) {
    const D = dims(s), T = dtypes(s);
    const N = D.N, r = D.r, hl = D.hl, kvl = D.kvl, f_l = D.f_l, a_l = D.a_l;
    const h = s.hidden, R = T.R, C = T.C, Dsm = T.Dsm, cast = T.cast;
    const P = paramCounts(s);
    const nh = N * h / r;
    const unit = a_l * s.seq * s.seq * s.micro_batch;
    const drop = s.dropout ? maskBytes : 0;
    const rope = s.pos === "rope", flash = s.attention === "flash";
    const qkv_out = C * N * (hl + 2 * kvl);
    const rotated = rope ? C * N * (hl + kvl) : 0;
    const [kept_p, events_p, fwd_p] = eagerCore(Dsm, C, cast, s.dropout, maskBytes, kernelTemps);
    const b1 = s.micro_batch === 1;
    const g_l = kvl / D.d;
    const k_copied = (g_l > 1 && kvl < hl) || !b1;
    const q_view_qkv = b1 && !rope, k_view_qkv = !k_copied && !rope;
    let eager_qkv = C * N * hl * (Number(!b1) + 2 * Number(k_copied));
    if (b1 && rope) eager_qkv += C * N * hl;
    if (!k_copied && rope) eager_qkv += C * N * kvl;
    if (q_view_qkv || k_view_qkv || !k_copied) eager_qkv += qkv_out;
    let v_release = k_copied ? C * N * hl : ((q_view_qkv || k_view_qkv) ? 0 : qkv_out);
    const eager_core = eager_qkv + kept_p * unit;
    let recomputed;
    if (s.recompute === "selective") {
      recomputed = C * N * hl * (Number(!b1) + 2 * Number(k_copied)) + kept_p * unit;
      v_release = k_copied ? C * N * hl : 0;
    } else recomputed = eager_core;
    let core;
    if (flash) core = qkv_out + rotated + 4 * a_l * s.micro_batch * s.seq;
    else if (s.recompute === "selective") core = qkv_out + rotated;
    else core = eager_core;
    const wc = cast ? 2 : 0;
    const norm = R * nh + T.stat * N / r;
    const attn = { norm1: norm, qkv_input: C * nh, core, proj_input: C * N * hl, dropout_mask: drop * nh,
                   weight_copies: wc * (P.attn_w + P.attn_b) };
    const nMlp = { relu: 1, gelu: 2, swiglu: 4 }[s.ffn_act];
    const mlp = { norm2: norm, mlp_input: C * nh, mlp_hidden: nMlp * C * N * f_l, dropout_mask: drop * nh,
                  weight_copies: wc * (P.mlp_w + P.mlp_b) };
    const branch = (s.dropout || cast) ? C * nh : 0;
    const wgrad16 = cast ? 2 * (P.mlp_w / (s.ffn_act === "swiglu" ? 3 : 2)) : 0;
    const mlp_extra = Math.max(C * N * f_l + branch + wgrad16, { relu: 2, gelu: 1, swiglu: 2 }[s.ffn_act] * C * N * f_l);
    let attn_extra, attn_fwd;
    if (flash) {
      attn_extra = C * N * hl + C * N * (hl + 2 * kvl) + 4 * a_l * s.micro_batch * s.seq;
      if (C === 2) attn_extra += 4 * N * hl;
      if (kvl < hl) attn_extra += 2 * C * N * hl;
      attn_fwd = 0.0;
    } else {
      attn_extra = -Infinity;
      for (const [u, n] of events_p) {
        const x = (u - kept_p) * unit + (n ? 2 * C * N * hl : C * N * hl - v_release);
        if (x > attn_extra) attn_extra = x;
      }
      attn_fwd = fwd_p * unit;
    }
    const stream = R * nh;
    const norm_extra = (s.norm === "rms" ? 4 * 4 : R) * nh + R * nh;
    return { attn, mlp, eager_core, recomputed_core: recomputed, mlp_extra, attn_extra, attn_fwd, stream,
             norm_extra, checkpoint: R * nh, norm };
  }
  const sum = (o) => Object.values(o).reduce((x, y) => x + y, 0);
  function precise(s, maskBytes, kernelTemps) {
    check(s, "precise");
    maskBytes = maskBytes === undefined ? 1 : maskBytes;
    kernelTemps = kernelTemps === undefined ? true : kernelTemps;
    const D = dims(s), T = dtypes(s), P = paramCounts(s);
    const N = D.N, r = D.r, v_l = D.v_l, h = s.hidden, C = T.C, L = s.layers, dpz = s.dp;
    const lt = layerTerms(s, maskBytes, kernelTemps);
    const attn_part = sum(lt.attn), mlp_part = sum(lt.mlp);
    const full = s.recompute === "full";
    const nh = N * h / r;
    const n_local = P.total;
    const params_b = T.param * n_local / (s.zero >= 3 ? dpz : 1);
    const opt_b = T.opt * n_local / (s.zero >= 1 ? dpz : 1);
    const grad_scale = T.grad / (s.zero >= 2 ? dpz : 1);
    const grads_all = grad_scale * n_local;
    const d_head = s.hidden / s.heads;
    let buffers = s.attention === "eager" ? s.seq * s.seq : 0;
    if (s.pos === "rope") buffers += 2 * s.seq * d_head * 4 + (C === 2 ? 2 * s.seq * d_head * 2 : 0);
    const inputs = 16 * N;
    const workspace = s.workspace_mib * MiB;
    const persistent = params_b + opt_b + buffers + inputs + workspace;
    const head_part = { final_norm: lt.norm, head_input: C * nh, head_weight_copy: T.cast ? 2 * v_l * h : 0,
                        log_probs: (T.cast ? 2 + 4 : 4) * N * v_l };
    const emb_part = (s.dropout ? maskBytes : 0) * nh;
    const per_layer = full ? lt.checkpoint : attn_part + mlp_part;
    const saved_all = L * per_layer + sum(head_part) + emb_part;
    const logits_c = C * N * v_l;
    const zero3 = s.zero >= 3 ? 2 * P.layer * T.param : 0;
    const moments = [];
    const grads = (now) => (s.grad_buffers ? grads_all : now);
    let fwd_extra = logits_c + (C === 2 && !T.cast ? 4 * N * v_l : 0);
    if (T.cast && full) fwd_extra += 2 * L * (P.attn_w + P.attn_b + P.mlp_w + P.mlp_b);
    moments.push(["end of forward (loss)", saved_all, grads(0), fwd_extra]);
    moments.push(["backward: log-softmax", saved_all, grads(0), (T.cast ? 4 : 8) * N * v_l]);
    let g_now = grad_scale * (!s.tied ? P.head : P.embed);
    moments.push(["backward: output projection", saved_all - head_part.log_probs, grads(g_now),
                  logits_c + C * nh + (T.cast ? 2 * v_l * h : 0) + zero3 / 2]);
    let saved = saved_all - sum(head_part) + head_part.final_norm;
    g_now += grad_scale * P.final_norm;
    moments.push(["backward: final norm", saved, grads(g_now), lt.norm_extra + zero3 / 2]);
    saved -= head_part.final_norm;
    const layer_mlp_grads = grad_scale * (P.mlp_w + P.mlp_b + P.norm);
    const layer_attn_grads = grad_scale * (P.attn_w + P.attn_b + P.norm);
    for (let i = L; i > 0; i--) {
      const tag = `layer ${i}`;
      if (full) {
        saved += attn_part + mlp_part - lt.checkpoint;
        moments.push([`backward ${tag}: recompute`, saved - mlp_part, grads(g_now), lt.attn_fwd + zero3]);
      }
      const down = grad_scale * (D.f_l * h + (s.bias ? h : 0));
      moments.push([`backward ${tag}: MLP`, saved - lt.mlp.dropout_mask, grads(g_now + down), lt.mlp_extra + lt.stream + zero3]);
      saved -= mlp_part - lt.mlp.norm2;
      g_now += layer_mlp_grads;
      moments.push([`backward ${tag}: norm 2`, saved, grads(g_now), lt.norm_extra + lt.stream + zero3]);
      saved -= lt.mlp.norm2;
      let extra = lt.attn_extra + lt.stream + zero3;
      if (s.recompute === "selective" && s.attention === "eager") extra += lt.recomputed_core;
      const proj = grad_scale * (D.hl * h + (s.bias ? h : 0));
      const done = lt.attn.dropout_mask + (s.attention === "flash" ? 0 : lt.attn.proj_input);
      moments.push([`backward ${tag}: attention`, saved - done, grads(g_now + proj), extra]);
      saved -= attn_part - lt.attn.norm1;
      g_now += layer_attn_grads;
      moments.push([`backward ${tag}: norm 1`, saved, grads(g_now), lt.norm_extra + lt.stream + zero3]);
      saved -= lt.attn.norm1;
    }
    g_now += grad_scale * (P.pos + (!s.tied ? P.embed : 0));
    moments.push(["backward: embedding", saved, grads(g_now), s.tied ? 2 * grad_scale * P.embed : 0]);
    const opt_temp = s.optimizer === "foreach" ? 4 * n_local / (s.zero >= 1 ? dpz : 1) : 0;
    moments.push(["optimizer step", 0, grads_all, opt_temp]);
    let best = moments[0];
    for (const m of moments) if (m[1] + m[2] + m[3] > best[1] + best[2] + best[3]) best = m;
    const [peak_name, kept, g_peak, transient] = best;
    const total = persistent + kept + g_peak + transient;
    let maxTransient = -Infinity;
    for (const m of moments) maxTransient = Math.max(maxTransient, m[3]);
    const per = full ? { "layer inputs (checkpoints)": lt.checkpoint } : Object.assign({},
      ...Object.entries(lt.attn).map(([k, v]) => ({ [`attention: ${k.replace(/_/g, " ")}`]: v })),
      ...Object.entries(lt.mlp).map(([k, v]) => ({ [`MLP: ${k.replace(/_/g, " ")}`]: v })));
    const children = Object.entries(per).filter(([, v]) => v).map(([k, v]) => ({ name: `${k} (x ${L})`, bytes: v * L }));
    for (const [k, v] of Object.entries(head_part)) if (v) children.push({ name: `output: ${k.replace(/_/g, " ")}`, bytes: v });
    if (emb_part) children.push({ name: "embedding dropout mask", bytes: emb_part });
    return {
      mode: "precise", total, params: paramCounts(s, 1).total, peak_moment: peak_name,
      lines: [
        { name: "parameters", bytes: params_b, in_total: true },
        { name: "gradients", bytes: g_peak, in_total: true },
        { name: "optimizer", bytes: opt_b, in_total: true },
        { name: "activations", bytes: kept, in_total: true },
        { name: "temporaries", bytes: transient, in_total: true },
        { name: "buffers + token ids", bytes: buffers + inputs, in_total: true },
        { name: "framework", bytes: workspace, in_total: true },
        { name: "activations at the end of forward", bytes: saved_all, in_total: false, children },
      ],
      moments: moments.map(([n, k, g, x]) => ({ name: n, bytes: persistent + k + g + x })),
      all_at_once: persistent + grads_all + saved_all + maxTransient,
    };
  }

  // ---------------------------------------------------------------- cost.py
  function trainingFlops(params, tokens, layers, hidden, seq) {
    const dense = 6.0 * params * tokens, attention = 12.0 * layers * hidden * seq * tokens;
    return { dense, attention, total: dense + attention };
  }
  function cost(params, tokens, layers, hidden, seq, tflops, price, peakTflops, publishedHours) {
    const f = trainingFlops(params, tokens, layers, hidden, seq);
    const hours = f.total / (tflops * 1e12) / 3600.0;
    const out = { flops: f.total, gpu_hours: hours, dollars: hours * price, implied_mfu: null };
    if (publishedHours) out.implied_mfu = f.total / (publishedHours * 3600.0 * peakTflops * 1e12);
    return out;
  }

  function estimate(s, mode) { return mode === "playbook" ? playbook(s) : precise(s); }
  return { check, playbook, precise, estimate, formatBytes, formatGiB, paramCounts, pbParamCount, trainingFlops, cost, kvHeads };
})();
if (typeof module !== "undefined") module.exports = FTMemory;
