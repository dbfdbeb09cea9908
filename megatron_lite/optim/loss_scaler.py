"""Loss scaling for fp16: constant, or dynamic (back off on overflow, grow after a clean window)."""
from __future__ import annotations


class DynamicLossScaler:
    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_interval: int = 1000,
                 hysteresis: int = 2, backoff_factor: float = 0.5, growth_factor: float = 2.0):
        self.scale = float(initial_scale)
        self.min_scale, self.growth_interval = min_scale, growth_interval
        self.hysteresis, self.backoff_factor, self.growth_factor = hysteresis, backoff_factor, growth_factor
        self._hysteresis_left = hysteresis
        self._clean_steps = 0

    def update(self, found_inf: bool) -> None:
        """Megatron's rule: every overflow uses up one unit of hysteresis; when none is left the
        scale is multiplied by backoff_factor. growth_interval clean steps grow it again."""
        if found_inf:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


class ConstantLossScaler:
    def __init__(self, scale: float = 1.0):
        self.scale = scale

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
