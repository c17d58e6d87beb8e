# The reference article's run (REFERENCE section 5): GPT-2 small, batch 12, block 1024,
# fp16 autocast + GradScaler, manual attention, gradients kept between steps, logits dropped
# before backward.    python train.py config/audit_reference.py --audit
preset = "gpt2"
batch_size = 12
block_size = 1024
dtype = "float16"
attention = "manual"
set_to_none = False
keep_logits = False
