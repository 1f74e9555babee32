import time, torch, importlib
t=time.time()
for m in ["transformers","tokenizers","peft","liger_kernel","torchao","safetensors","scipy","rich","matplotlib"]:
    try:
        mod=importlib.import_module(m); print(m, getattr(mod,"__version__","?"))
    except Exception as e: print(m, "FAIL", e)
print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.mem_get_info())
from transformers import LlamaConfig, AutoModelForCausalLM, GPT2Config
import inspect
cfg=LlamaConfig(vocab_size=1000,hidden_size=256,intermediate_size=512,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2)
m=AutoModelForCausalLM.from_config(cfg).cuda()
x=torch.randint(0,1000,(2,64),device="cuda")
out=m(input_ids=x, labels=x, shift_labels=x)
print("shift_labels ok", out.loss.item())
try:
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    _apply_liger_kernel_to_instance(model=m)
    with torch.autocast("cuda",dtype=torch.bfloat16):
        out=m(input_ids=x, labels=x, shift_labels=x)
    out.loss.backward(); print("liger ok", out.loss.item(), out.logits)
except Exception as e: print("liger FAIL", repr(e)[:300])
import torchao
try:
    from torchao.optim import AdamW8bit; print("adamw8bit ok")
except Exception as e: print("ao FAIL", e)
print("probe s", time.time()-t)
