defmodule EMLXAxon.TextGeneration.Serving.Execution do
  @moduledoc false
  # One serving execution, without Nx: generates a batch of requests as one
  # native generation and encodes the results for the callers.

  alias EMLXAxon.Generation
  alias EMLXAxon.TextGeneration.Input
  alias EMLXAxon.TextGeneration.Serving.{Batch, Results}

  @doc """
  Runs `requests` with the serving's `tokenizer`, `model` and `opts` on
  `stream` (an `EMLXAxon.Stream` or `nil`), calling `on_chunk` (if any) with
  each native chunk's rows. Returns `Results.encode/3`'s fields; raises
  on failure. `callers` are the processes waiting for the rows, one a row:
  a row whose caller has exited (see `Batch.gone_rows/1`) ends within a
  step (`:cancelled`), and once they all have the generation stops, as on
  a timeout: nobody would read its rows.
  """
  @spec run(map(), [Input.request()], EMLXAxon.Stream.t() | nil, Generation.on_chunk(), [
          pid() | nil
        ]) ::
          %{atom() => Results.field()}
  def run(
        %{tokenizer: tokenizer, state: model, opts: opts},
        requests,
        stream,
        on_chunk,
        callers \\ []
      ) do
    prompts = Enum.map(requests, & &1.ids)

    opts =
      opts
      |> Map.put(:gone_rows, fn -> Batch.gone_rows(callers) end)
      |> Map.put(:row_seeds, Input.row_seeds(requests, opts.seed))
      |> Map.put(:row_constraints, Input.row_constraints(requests, opts.constraint))

    stream_ref = EMLXAxon.Stream.resolve(stream)

    case Generation.run(model, tokenizer, stream_ref, prompts, opts, on_chunk) do
      {:ok, %{rows: rows, stats: stats}} -> Results.encode(rows, stats, opts.max_new_tokens)
      {:error, error} -> raise error
    end
  end
end
