"""Environment adapters: one class per suite behind `tiderl.envs.adapters.base.Adapter`."""
