defmodule EMLXAxon.Qwen3.Model do
  @moduledoc """
  A Qwen3 (or Qwen2) decoder loaded on MLX by `EMLXAxon.Qwen3.Loader`.

  The model's weights live in native memory, held by
  `EMLXAxon.Qwen3.Model.State`; they are freed when the state is garbage
  collected. A state can be shared by any number of processes and
  generations at once.
  """

  alias EMLXAxon.{Error, Native}
  alias EMLXAxon.Qwen3.Model.State

  @doc """
  Returns the model's configuration as reported by the engine (the same map
  as `state.config`, read again from the native model).

  ## Examples

      {:ok, %{model_type: "qwen3", num_layers: 28}} = EMLXAxon.Qwen3.Model.info(state)

  """
  @spec info(State.t()) :: {:ok, State.config()} | {:error, Error.t()}
  def info(%State{ref: ref}), do: Error.wrap(Native.model_info(ref))
end
