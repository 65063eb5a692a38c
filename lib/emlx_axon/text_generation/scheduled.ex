defmodule EMLXAxon.TextGeneration.Scheduled do
  @moduledoc false
  # Runs EMLXAxon.TextGeneration's encoded requests through an
  # EMLXAxon.Scheduler: each input is its own scheduler request (with its
  # own seed and constraint), its tokens are gathered (and streamed) from
  # the scheduler's messages, and the outputs have the shape of a direct run.

  alias EMLXAxon.{Error, Result, Scheduler}
  alias EMLXAxon.TextGeneration.Output

  @request_keys [
    :max_new_tokens,
    :max_len,
    :sampler,
    :temperature,
    :top_p,
    :top_k,
    :min_p,
    :stop,
    :eos_token_ids,
    :ignore_eos,
    :timeout
  ]

  @doc """
  Raises `ArgumentError` when `opts` or `requests` ask for what the
  scheduler cannot do, or `state` is not the scheduler's model.
  """
  @spec check!(Scheduler.server(), EMLXAxon.Qwen3.Model.State.t(), [map()], map()) :: :ok
  def check!(scheduler, state, _requests, opts) do
    if opts.mlx_stream do
      raise ArgumentError,
            "an EMLXAxon.Stream (:stream or :mlx_stream) cannot be used with :scheduler: " <>
              "the scheduler runs on the stream it was started on"
    end

    %{model: model, tokenizer: tokenizer} = info!(scheduler)

    if model.ref != state.ref do
      raise ArgumentError,
            "the :scheduler serves a different model than the state given; " <>
              "pass the state the scheduler was started with"
    end

    if tokenizer == nil do
      raise ArgumentError,
            "the :scheduler must be started with a :tokenizer to return text"
    end

    :ok
  end

  defp info!(scheduler) do
    Scheduler.model(scheduler)
  catch
    # No such process: the option names no running scheduler.
    :exit, {:noproc, _} = reason ->
      raise ArgumentError,
            "expected :scheduler to be a running EMLXAxon.Scheduler, " <>
              "got: #{inspect(scheduler)} (#{inspect(reason)})"

    # A scheduler that exited (or is exiting).
    :exit, reason ->
      raise down(scheduler, exit_reason(reason))
  end

  @doc """
  Submits `requests` and waits for them all. `emit` is `nil` or receives
  `{index, text}` for each new piece of text. Every request still running
  when this returns or raises is cancelled.
  """
  @spec run!(Scheduler.server(), [map()], map(), nil | (term() -> term())) :: [map()]
  def run!(scheduler, requests, opts, emit) do
    started = System.monotonic_time()
    base = Enum.map(@request_keys, &{&1, Map.fetch!(opts, &1)})
    rows = Map.new(Enum.with_index(requests), fn {_request, i} -> {i, {[], [], nil, nil}} end)
    defaults = {opts.seed, opts.constraint}
    # Requests go to the process found now, which is watched: when it
    # exits, nothing more will come, and waiting would never end.
    scheduler = whereis!(scheduler)
    monitor = Process.monitor(scheduler)
    refs = submit_all(scheduler, Enum.with_index(requests), base, defaults, %{})

    try do
      rows = await({scheduler, monitor}, refs, rows, emit)
      total_ms = ms(System.monotonic_time() - started)

      for {request, index} <- Enum.with_index(requests) do
        finish(request, Map.fetch!(rows, index), length(requests), total_ms)
      end
    after
      # Whatever ended early (emit raised, an error, an exit) frees its rows.
      cancel_all(scheduler, refs)
      Process.demonitor(monitor, [:flush])
    end
  end

  @doc """
  The pid of `scheduler`; raises `EMLXAxon.Error` (kind `:scheduler_down`)
  when no process runs under that name.
  """
  @spec whereis!(Scheduler.server()) :: pid()
  def whereis!(scheduler) do
    case GenServer.whereis(scheduler) do
      pid when is_pid(pid) -> pid
      _ -> raise down(scheduler, :noproc)
    end
  end

  @doc "The error of a request whose `scheduler` exited with `reason`."
  @spec down(Scheduler.server(), term()) :: Error.t()
  def down(scheduler, reason) do
    Error.exception(
      kind: :scheduler_down,
      message: "the scheduler #{inspect(scheduler)} is not running (#{inspect(reason)})"
    )
  end

  defp submit_all(_scheduler, [], _base, _defaults, refs), do: refs

  # `defaults`: the options' seed and constraint, for inputs without their own.
  defp submit_all(scheduler, [{request, index} | rest], base, defaults, refs) do
    {seed, constraint} = defaults

    result =
      try do
        constraint = List.wrap(Map.get(request, :constraint) || constraint)

        Scheduler.submit(
          scheduler,
          request.ids,
          [seed: request.seed || seed] ++ constraint ++ base
        )
      catch
        # It exited before answering.
        :exit, reason ->
          cancel_all(scheduler, refs)
          raise down(scheduler, exit_reason(reason))

        kind, reason ->
          cancel_all(scheduler, refs)
          :erlang.raise(kind, reason, __STACKTRACE__)
      end

    case result do
      {:ok, ref} ->
        submit_all(scheduler, rest, base, defaults, Map.put(refs, ref, index))

      {:error, error} ->
        cancel_all(scheduler, refs)

        if error == :overloaded,
          do: raise(Error, kind: :overloaded, message: "the scheduler's queue is full"),
          else: raise(error)
    end
  end

  defp exit_reason({reason, {GenServer, :call, _}}), do: reason
  defp exit_reason(reason), do: reason

  defp await(_scheduler, refs, rows, _emit) when map_size(refs) == 0, do: rows

  defp await({pid, monitor} = scheduler, refs, rows, emit) do
    receive do
      # The scheduler's own messages come first, then this one.
      {:DOWN, ^monitor, :process, _, reason} ->
        raise down(pid, reason)

      {Scheduler, ref, event} when is_map_key(refs, ref) ->
        index = Map.fetch!(refs, ref)
        {ids, text, _, _} = row = Map.fetch!(rows, index)

        case event do
          {:tokens, new_ids, new_text} ->
            if emit && new_text != "", do: emit.({index, new_text})
            row = put_elem(put_elem(row, 0, [new_ids | ids]), 1, [text, new_text])
            await(scheduler, refs, Map.put(rows, index, row), emit)

          {:done, reason, stats} ->
            row = row |> put_elem(2, reason) |> put_elem(3, stats)
            await(scheduler, Map.delete(refs, ref), Map.put(rows, index, row), emit)

          {:error, error} ->
            raise error
        end
    end
  end

  # Cancels what is still running and drops its pending messages, so
  # neither a slot nor the caller's mailbox keeps anything of it.
  defp cancel_all(scheduler, refs) do
    for {ref, _index} <- refs do
      Scheduler.cancel(scheduler, ref)
      flush(ref)
    end

    :ok
  catch
    # The scheduler is gone: nothing of it is left to free.
    :exit, _ -> :ok
  end

  defp flush(ref) do
    receive do
      {Scheduler, ^ref, _event} -> flush(ref)
    after
      0 -> :ok
    end
  end

  defp finish(request, {ids, text, reason, stats}, batch_size, total_ms) do
    ids = ids |> Enum.reverse() |> Enum.concat()
    # A request that timed out has no stats: its prompt is known here.
    stats = Map.put_new(stats || %{}, :prompt_tokens, length(request.ids))
    metadata = Result.scheduled_metadata(stats, length(ids), batch_size, total_ms)

    row = %{
      ids: ids,
      text: IO.iodata_to_binary(text),
      finish_reason: reason,
      prompt_tokens: metadata.prompt_tokens,
      padding: 0
    }

    Output.build(row, metadata)
  end

  defp ms(native), do: System.convert_time_unit(native, :native, :microsecond) / 1000
end
