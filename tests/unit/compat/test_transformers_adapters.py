"""The transformers adapter: what the Trainer's private settings neutrain depends on still mean."""

from transformers import TrainingArguments

from neutrain import compat


def test_one_gpu_per_process_turns_off_data_parallel(tmp_path):
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    assert args.n_gpu == 0 and not compat.use_one_gpu_per_process(args)
    args._n_gpu = 2  # what a single process on a 2-GPU host gets (Trainer would wrap in nn.DataParallel)
    assert args.n_gpu == 2
    assert compat.use_one_gpu_per_process(args)
    assert args.n_gpu == 1
    assert args.train_batch_size == args.per_device_train_batch_size  # no longer multiplied by the GPU count
