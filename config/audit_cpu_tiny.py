# A tiny model for a quick audit on any machine.    python train.py config/audit_cpu_tiny.py --audit
preset = "cpu-tiny"
batch_size = 2
