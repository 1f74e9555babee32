// fasttrain.memory in the browser: a line-by-line port of playbook.py, precise.py (with
// training_state.py) and cost.py.
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
  const OPTIMS = ["adamw", "adamw_8bit", "adafactor", "sgd", "sgd_momentum"];
  const OPTIM_ALIASES = ["adamw_torch", "adamw_torch_fused", "adamw_fused"];
  const LORA_KINDS = ["qkv", "proj", "up", "down", "head"];
  const FLAG = { micro_batch: "--micro-batch", opt_bytes: "--opt-bytes", kv_heads: "--kv-heads", ffn_act: "--ffn-act",
                 lora_rank: "--lora-r", prompt_tokens: "--prompt-tokens" };
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
    checkTraining(s, mode);
    return s;
  }
  const frozen = (s) => s.lora_rank > 0 || s.prompt_tokens > 0;
  function checkTraining(s, mode) {
    if (!OPTIMS.includes(s.optim)) throw new Error(`--optim must be one of ${OPTIMS.concat(OPTIM_ALIASES).join(", ")}, got '${s.optim}'`);
    for (const name of ["lora_rank", "prompt_tokens"]) {
      if (!isInt(s[name]) || s[name] < 0) throw new Error(`${flag(name)} must be a non-negative integer, got ${s[name]}`);
    }
    if (typeof s.lora_dropout !== "number" || !(s.lora_dropout >= 0 && s.lora_dropout < 1)) throw new Error(`--lora-dropout must be in [0, 1), got ${s.lora_dropout}`);
    const targets = s.lora_targets;
    if (!Array.isArray(targets) || !targets.every((x) => LORA_KINDS.includes(x)) || new Set(targets).size !== targets.length)
      throw new Error(`--lora-targets must be distinct names among ${LORA_KINDS.join(", ")}, got ${JSON.stringify(targets)}`);
    if (mode === "playbook" && (s.optim !== "adamw" || frozen(s))) throw new Error("--optim, --lora-r and --prompt-tokens exist only in --mode precise; the widget knows --opt-bytes");
    if (s.optim !== "adamw" && s.opt_bytes !== 8) throw new Error(`--opt-bytes is AdamW's k; --optim ${s.optim} counts its own state: drop --opt-bytes`);
    if (s.optimizer === "fused" && (s.optim === "adamw_8bit" || s.optim === "adafactor")) throw new Error(`--optim ${s.optim} has no fused implementation: use --optimizer foreach`);
    if (s.lora_rank && s.prompt_tokens) throw new Error("give --lora-r or --prompt-tokens, not both");
    if (s.lora_rank && !targets.length) throw new Error(`--lora-targets is empty; name at least one of ${LORA_KINDS.join(", ")}`);
    if (s.lora_rank && targets.includes("head") && s.tied) throw new Error("LoRA on the head needs an untied output projection (--untied), or drop 'head'");
    if (frozen(s) && s.tp > 1) throw new Error("LoRA and prompt tuning are modelled on one tensor-parallel rank: use --tp 1");
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

  // ---------------------------------------------------------------- training_state.py
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
  const numel = (shape) => shape.reduce((x, y) => x * y, 1);
  function linearShapes(s) {
    const D = dims(s), nUp = s.ffn_act === "swiglu" ? 2 : 1;
    return { qkv: [D.hl + 2 * D.kvl, s.hidden], proj: [s.hidden, D.hl], up: [nUp * D.f_l, s.hidden],
             down: [s.hidden, D.f_l], head: [D.v_l, s.hidden] };
  }
  function paramShapes(s) {
    const h = s.hidden, lin = linearShapes(s);
    const norm = s.norm === "layer" && s.bias ? [[h], [h]] : [[h]];
    const out = [[lin.head[0], h]];
    if (s.pos === "learned") out.push([s.seq, h]);
    for (let i = 0; i < s.layers; i++) {
      out.push(...norm);
      for (const k of ["qkv", "proj"]) { out.push(lin[k]); if (s.bias) out.push([lin[k][0]]); }
      out.push(...norm);
      for (const k of ["up", "down"]) { out.push(lin[k]); if (s.bias) out.push([lin[k][0]]); }
    }
    out.push(...norm);
    if (!s.tied) out.push(lin.head);
    return out;
  }
  function loraShapes(s, kind) {
    const [o, i] = linearShapes(s)[kind];
    return [[s.lora_rank, i], [o, s.lora_rank]];
  }
  function trainableShapes(s) {
    if (s.lora_rank) {
      const perLayer = [];
      for (const k of ["qkv", "proj", "up", "down"]) if (s.lora_targets.includes(k)) perLayer.push(...loraShapes(s, k));
      const out = [];
      for (let i = 0; i < s.layers; i++) out.push(...perLayer);
      if (s.lora_targets.includes("head")) out.push(...loraShapes(s, "head"));
      return out;
    }
    if (s.prompt_tokens) return [[s.prompt_tokens, s.hidden]];
    return paramShapes(s);
  }
  const AO_BLOCK = 256, AO_MIN_NUMEL = 4096, AO_QMAP = 256 * 4;
  function optimizerStateBytes(s, shapes) {
    const n = shapes.reduce((x, sh) => x + numel(sh), 0);
    const master = s.precision === "mixed" ? 4 * n : 0;
    if (s.optim === "adamw") return s.opt_bytes * n + master;
    if (s.optim === "sgd") return master;
    if (s.optim === "sgd_momentum") return 4 * n + master;
    let total = 0;
    for (const sh of shapes) {
      const k = numel(sh);
      if (s.optim === "adafactor") total += sh.length >= 2 ? 4 * (numel(sh.slice(0, -1)) + numel(sh.slice(0, -2)) * sh[sh.length - 1]) : 4 * k;
      else if (k >= AO_MIN_NUMEL && k % AO_BLOCK === 0) total += 2 * (k + 4 * Math.floor(k / AO_BLOCK) + AO_QMAP);
      else total += 2 * 4 * k;
    }
    return total + master;
  }
  // training_state.step_groups (D13): under tp the optimizer steps the split tensors (the blocks' linears, the
  // vocabulary -- split here, Megatron's layout) and the replicated ones (norms, positions) as two groups
  function stepGroups(s, shapes) {
    if (s.tp === 1 || s.lora_rank || s.prompt_tokens) return [shapes];
    const h = s.hidden, lin = linearShapes(s), nNorm = s.norm === "layer" && s.bias ? 2 : 1;
    const split = [[lin.head[0], h]], whole = [];
    if (s.pos === "learned") whole.push([s.seq, h]);
    for (let i = 0; i < s.layers; i++) {
      for (const k of ["qkv", "proj", "up", "down"]) { split.push(lin[k]); if (s.bias) split.push([lin[k][0]]); }
      for (let j = 0; j < 2 * nNorm; j++) whole.push([h]);
    }
    for (let j = 0; j < nNorm; j++) whole.push([h]);
    if (!s.tied) split.push(lin.head);
    return [split, whole].filter((g) => g.length);
  }
  function optimizerTempBytes(s, shapes) {
    if (s.optim === "adamw") {
      if (s.optimizer !== "foreach") return 0;
      return 4 * Math.max(...stepGroups(s, shapes).map((g) => g.reduce((x, sh) => x + numel(sh), 0)));
    }
    if (s.optim === "adafactor") return shapes.reduce((x, sh) => x + 4 * numel(sh) * (sh.length >= 2 ? 1 : 2), 0);
    if (s.optim === "adamw_8bit") {
      let m = 0;
      for (const sh of shapes) { const k = numel(sh); if (k >= AO_MIN_NUMEL && k % AO_BLOCK === 0 && k > m) m = k; }
      return 2 * 4 * m;
    }
    return 0;
  }
  // ---------------------------------------------------------------- precise.py
  function loraKept(s, kind, maskBytes) {
    const T = dtypes(s), N = s.seq * s.micro_batch, inF = linearShapes(s)[kind][1];
    return T.C * N * s.lora_rank + (s.lora_dropout > 0 ? maskBytes * N * inF : 0);
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
    const fz = frozen(s);
    const keeps = {}, lora = {};
    for (const k of LORA_KINDS) {
      const on = s.lora_rank > 0 && s.lora_targets.includes(k);
      keeps[k] = !fz || on;
      lora[k] = on ? loraKept(s, k, maskBytes) : 0;
    }
    const lin = linearShapes(s);
    let attnCopies, mlpCopies;
    if (fz) {
      const copies = {};
      for (const k of LORA_KINDS) copies[k] = wc * (numel(lin[k]) + (lora[k] ? loraShapes(s, k).reduce((x, sh) => x + numel(sh), 0) : 0));
      attnCopies = copies.qkv + copies.proj; mlpCopies = copies.up + copies.down;
    } else {
      attnCopies = wc * (P.attn_w + P.attn_b); mlpCopies = wc * (P.mlp_w + P.mlp_b);
    }
    const attn = { norm1: norm, qkv_input: keeps.qkv ? C * nh : 0, core, proj_input: (keeps.proj || flash) ? C * N * hl : 0,
                   dropout_mask: drop * nh, weight_copies: attnCopies };
    let nMlp = { relu: 1, gelu: 2, swiglu: 4 }[s.ffn_act];
    if (!keeps.down && s.ffn_act !== "relu") nMlp -= 1;
    const mlp = { norm2: norm, mlp_input: keeps.up ? C * nh : 0, mlp_hidden: nMlp * C * N * f_l, dropout_mask: drop * nh,
                  weight_copies: mlpCopies };
    if (s.lora_rank) { attn.lora = lora.qkv + lora.proj; mlp.lora = lora.up + lora.down; }
    const branch = (s.dropout || cast) ? C * nh : 0;
    const wgrad16 = cast && !fz ? 2 * (P.mlp_w / (s.ffn_act === "swiglu" ? 3 : 2)) : 0;
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
    const loraBack = {};
    for (const k of LORA_KINDS) loraBack[k] = lora[k] ? C * N * lin[k][1] : 0;
    return { attn, mlp, eager_core, recomputed_core: recomputed, mlp_extra: mlp_extra + Math.max(loraBack.up, loraBack.down),
             attn_extra: attn_extra + Math.max(loraBack.qkv, loraBack.proj), attn_fwd, stream,
             norm_extra, checkpoint: R * nh, norm, keeps, lora };
  }
  function firstLayer(s, lt) {
    let attn = Object.assign({}, lt.attn), mlp = Object.assign({}, lt.mlp);
    const order = ["qkv", "proj", "up", "down"].filter((k) => s.lora_targets.includes(k));
    if (!s.lora_rank || s.prompt_tokens) return [attn, mlp, new Set()];
    const first = order.length ? order[0] : "head";
    const T = dtypes(s), C = T.C, N = s.seq * s.micro_batch, lin = linearShapes(s);
    const copy = (k) => (T.cast ? 2 * numel(lin[k]) : 0);
    attn.norm1 = 0;
    attn.weight_copies -= copy("qkv");
    const skipped = new Set(["norm 1"]);
    if (["proj", "up", "down", "head"].includes(first)) { attn.core = 0; skipped.add("attention core"); }
    if (["up", "down", "head"].includes(first)) {
      attn.proj_input = 0; attn.dropout_mask = 0;
      attn.weight_copies -= copy("proj");
      mlp.norm2 = 0;
      skipped.add("attention"); skipped.add("norm 2");
    }
    if (first === "down" || first === "head") {
      mlp.mlp_hidden = first === "down" ? C * N * lin.down[1] : 0;
      mlp.weight_copies -= copy("up");
    }
    if (first === "head") {
      for (const k of Object.keys(mlp)) mlp[k] = 0;
      for (const k of Object.keys(attn)) attn[k] = 0;
      skipped.add("MLP");
    }
    return [attn, mlp, skipped];
  }
  const sum = (o) => Object.values(o).reduce((x, y) => x + y, 0);
  function precise(sIn, maskBytes, kernelTemps) {
    check(sIn, "precise");
    maskBytes = maskBytes === undefined ? 1 : maskBytes;
    kernelTemps = kernelTemps === undefined ? true : kernelTemps;
    const textSeq = sIn.seq;
    const s = sIn.prompt_tokens ? Object.assign({}, sIn, { seq: sIn.seq + sIn.prompt_tokens }) : sIn;
    const D = dims(s), T = dtypes(s), P = paramCounts(sIn);
    const N = D.N, r = D.r, v_l = D.v_l, h = s.hidden, C = T.C, L = s.layers, dpz = s.dp;
    const N_out = textSeq * s.micro_batch;
    const lt = layerTerms(s, maskBytes, kernelTemps);
    const attn_part = sum(lt.attn), mlp_part = sum(lt.mlp);
    const full = s.recompute === "full";
    const nh = N * h / r;
    const fz = frozen(s), loraOnly = s.lora_rank > 0;
    const [attn_1, mlp_1, skipped_1] = firstLayer(s, lt);
    const loraN = (k) => (loraOnly && s.lora_targets.includes(k) ? loraShapes(s, k).reduce((x, sh) => x + numel(sh), 0) : 0);
    const n_local = P.total;
    const trainShapes = trainableShapes(s);
    const n_train = trainShapes.reduce((x, sh) => x + numel(sh), 0);
    const n_adapters = fz ? n_train : 0;
    const params_b = T.param * (n_local + n_adapters) / (s.zero >= 3 ? dpz : 1);
    const opt_b = optimizerStateBytes(s, trainShapes) / (s.zero >= 1 ? dpz : 1);
    const grad_scale = T.grad / (s.zero >= 2 ? dpz : 1);
    const grads_all = grad_scale * n_train;
    const d_head = s.hidden / s.heads;
    let buffers = s.attention === "eager" ? s.seq * s.seq : 0;
    if (s.pos === "rope") buffers += 2 * s.seq * d_head * 4 + (C === 2 ? 2 * s.seq * d_head * 2 : 0);
    const inputs = 16 * N_out;
    const workspace = s.workspace_mib * MiB;
    const persistent = params_b + opt_b + buffers + inputs + workspace;
    const head_part = { final_norm: loraOnly && skipped_1.has("MLP") ? 0 : lt.norm, head_input: lt.keeps.head ? C * N_out * h / r : 0,
                        head_weight_copy: T.cast ? 2 * v_l * h : 0, log_probs: (T.cast ? 2 + 4 : 4) * N_out * v_l };
    if (lt.lora.head) head_part.lora = lt.lora.head + (T.cast ? 2 * loraN("head") : 0);
    const emb_part = (s.dropout && !loraOnly ? maskBytes : 0) * nh;
    const per_layer = full ? lt.checkpoint : attn_part + mlp_part;
    const first_layer = full ? lt.checkpoint : sum(attn_1) + sum(mlp_1);
    const n_first = skipped_1.has("MLP") ? L : 1;
    const saved_all = L * per_layer + n_first * (first_layer - per_layer) + sum(head_part) + emb_part;
    const logits_c = C * N_out * v_l;
    const zero3 = s.zero >= 3 ? 2 * P.layer * T.param : 0;
    const moments = [];
    const grads = (now) => (s.grad_buffers ? grads_all : now);
    let head_g, final_norm_g, down_g, mlp_g, proj_g, attn_g, embed_g;
    if (fz) {
      head_g = loraN("head"); final_norm_g = 0;
      down_g = loraN("down"); mlp_g = loraN("up") + loraN("down");
      proj_g = loraN("proj"); attn_g = loraN("qkv") + loraN("proj");
      embed_g = s.prompt_tokens ? n_train : 0;
    } else {
      head_g = !s.tied ? P.head : P.embed; final_norm_g = P.final_norm;
      down_g = D.f_l * h + (s.bias ? h : 0); mlp_g = P.mlp_w + P.mlp_b + P.norm;
      proj_g = D.hl * h + (s.bias ? h : 0); attn_g = P.attn_w + P.attn_b + P.norm;
      embed_g = P.pos + (!s.tied ? P.embed : 0);
    }
    let fwd_extra = logits_c + (C === 2 && !T.cast ? 4 * N_out * v_l : 0);
    if (T.cast && full && !fz) fwd_extra += 2 * L * (P.attn_w + P.attn_b + P.mlp_w + P.mlp_b);
    moments.push(["end of forward (loss)", saved_all, grads(0), fwd_extra]);
    moments.push(["backward: log-softmax", saved_all, grads(0), (T.cast ? 4 : 8) * N_out * v_l]);
    let g_now = grad_scale * head_g;
    moments.push(["backward: output projection", saved_all - head_part.log_probs, grads(g_now),
                  logits_c + C * N_out * h / r + (T.cast ? 2 * v_l * h : 0) + zero3 / 2 + (s.prompt_tokens ? C * nh : 0)]);
    let saved = saved_all - sum(head_part) + head_part.final_norm;
    g_now += grad_scale * final_norm_g;
    moments.push(["backward: final norm", saved, grads(g_now), lt.norm_extra + zero3 / 2]);
    saved -= head_part.final_norm;
    for (let i = L; i > 0; i--) {
      const tag = `layer ${i}`;
      const firstLike = i === 1 || skipped_1.has("MLP");
      const attn_i = firstLike ? attn_1 : lt.attn, mlp_i = firstLike ? mlp_1 : lt.mlp;
      const skip = firstLike ? skipped_1 : new Set();
      const a_part = sum(attn_i), m_part = sum(mlp_i);
      if (full) {
        saved += a_part + m_part - lt.checkpoint;
        moments.push([`backward ${tag}: recompute`, saved - m_part, grads(g_now), lt.attn_fwd + zero3]);
      }
      if (!skip.has("MLP")) moments.push([`backward ${tag}: MLP`, saved - mlp_i.dropout_mask, grads(g_now + grad_scale * down_g), lt.mlp_extra + lt.stream + zero3]);
      saved -= m_part - mlp_i.norm2;
      g_now += grad_scale * mlp_g;
      if (!skip.has("norm 2")) moments.push([`backward ${tag}: norm 2`, saved, grads(g_now), lt.norm_extra + lt.stream + zero3]);
      saved -= mlp_i.norm2;
      if (!skip.has("attention")) {
        let extra = lt.attn_extra + lt.stream + zero3;
        if (s.recompute === "selective" && s.attention === "eager" && !skip.has("attention core")) extra += lt.recomputed_core;
        const done = attn_i.dropout_mask + (s.attention === "flash" ? 0 : attn_i.proj_input);
        moments.push([`backward ${tag}: attention`, saved - done, grads(g_now + grad_scale * proj_g), extra]);
      }
      saved -= a_part - attn_i.norm1;
      g_now += grad_scale * attn_g;
      if (!skip.has("norm 1")) moments.push([`backward ${tag}: norm 1`, saved, grads(g_now), lt.norm_extra + lt.stream + zero3]);
      saved -= attn_i.norm1;
    }
    g_now += grad_scale * embed_g;
    if (!loraOnly) moments.push(["backward: embedding", saved, grads(g_now), s.tied && !fz ? 2 * grad_scale * P.embed : 0]);
    const opt_temp = optimizerTempBytes(s, trainShapes) / (s.zero >= 1 ? dpz : 1);
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
    if (first_layer !== per_layer) children.push({ name: (n_first > 1 ? "every layer" : "layer 1") + ": not kept (no gradient needed before the first LoRA target)", bytes: n_first * (first_layer - per_layer) });
    for (const [k, v] of Object.entries(head_part)) if (v) children.push({ name: `output: ${k.replace(/_/g, " ")}`, bytes: v });
    if (emb_part) children.push({ name: "embedding dropout mask", bytes: emb_part });
    return {
      mode: "precise", total, params: paramCounts(sIn, 1).total, peak_moment: peak_name,
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
      trainable_params: n_train, param_bytes: params_b, grad_bytes: grads_all, optimizer_bytes: opt_b,
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
  return { check, playbook, precise, estimate, OPTIMS, LORA_KINDS, formatBytes, formatGiB, paramCounts, pbParamCount, trainingFlops, cost, kvHeads };
})();
if (typeof module !== "undefined") module.exports = FTMemory;
